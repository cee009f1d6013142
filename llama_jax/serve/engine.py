"""Continuous batching for the server: requests join a running decode batch at chunk boundaries and leave when
done, and each gets exactly the tokens and log-probabilities it would get alone.

The batch (`DecodeBatch`) is `max_batch` rows of one KV cache of `capacity` positions. A request joins by being
prefilled alone (its prompt in a cache of its length bucket: the computation `Model.complete` runs for it; with
echo and logprobs the same pass scores its prompt), its keys and values copied into a free row; then it decodes
with the others, a chunk at a time, each row with its own settings, seed and token count. The engine keeps the
scheduling: which request holds which row, the queue, and each request's events.

A prompt that begins with one the engine has prefilled before (its prompt cache, `prefixes.PromptCache`) is prefilled
after those positions only (`prefill_after`: the same bits).

One thread (`Engine.run`) does all the device work, in order; the server's threads only `submit` requests and
read their events. A request that is cancelled (its client went away) leaves its slot at the next chunk.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from llama_jax.errors import EngineStoppedError, QueueFullError
from llama_jax.model import Model
from llama_jax.passes.decode_batch import (
    DecodeBatch,
    Prefilled,
    RowSettings,
    TokenLogprobs,
    prefill_after,
    prefill_row,
    reuses_prefixes,
)
from llama_jax.passes.sampling import Sampling
from llama_jax.serve.prefixes import PromptCache
from llama_jax.serve.protocol import TOP_LOGPROBS
from llama_jax.text.detokenize import TextStream
from llama_jax.text.grammar import Guide


@dataclasses.dataclass(frozen=True)
class Token:
    """One new token of a request: its id, the text it releases (empty while a character or a possible stop string
    is incomplete), and with logprobs its log-probability and the most likely tokens there [(id, logprob)]."""

    id: int
    text: str
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class Finished:
    """The end of a request: reason "stop" (an end-of-sequence token or a stop string), "length" (max_tokens),
    "cancelled", or "error" (the engine failed: text is the error's message); and the text still held back."""

    reason: str
    text: str = ""


@dataclasses.dataclass(frozen=True)
class PromptLogprobs:
    """A prompt's tokens scored (for echo with logprobs): each token's log-probability after the ones before it (the
    first has none: None) and the most likely tokens there [(id, logprob)] (none for the first)."""

    logprobs: tuple[float | None, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]


Event = Token | Finished | PromptLogprobs


@dataclasses.dataclass
class Request:
    """What the engine runs: prompt ids, how many new tokens at most, the sampling (one int seed), how many top
    log-probabilities each token reports (None: no log-probabilities), whether to score the prompt too, where its
    events go (emit: called from the engine's thread, in order), the matcher of its grammar (guide: its own, made
    from sampling.grammar; None: free), and whether its prompt may take a kept prompt's positions and be kept
    (cache_prompt, llama-server's field: either way the same bits). cancel() frees its slot at the next chunk."""

    ids: list[int]
    max_tokens: int
    sampling: Sampling
    emit: Callable[[Event], None]
    logprobs: int | None = None
    prompt_logprobs: bool = False
    guide: Guide | None = None
    cache_prompt: bool = True
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclasses.dataclass
class _Slot:
    request: Request
    stream: TextStream
    made: int = 0  # new tokens so far


class Engine:
    """The decode batch of a model: `submit` requests (from any thread), `run` the loop (in one thread) until
    `stop`. max_batch: the slots; capacity: the positions of a slot (a request's prompt and new tokens must fit);
    queue: how many requests may wait for a slot before `submit` refuses (QueueFullError); prompt_cache: the bytes
    of prefilled prompts kept for the requests that begin with one (`prefixes.PromptCache`; 0: none, and none for
    a model whose prompts cannot reuse another's: `reuses_prefixes`)."""

    def __init__(self, model: Model, max_batch: int = 8, capacity: int = 2048, queue: int = 64, prompt_cache: int = 0):
        self.model, self.max_batch, self.capacity, self.queue_size = model, max_batch, capacity, queue
        self.prompts = PromptCache(prompt_cache if reuses_prefixes(model.config) else 0)
        self.waiting: collections.deque[Request] = collections.deque()
        self.wake = threading.Condition()
        self.stopping = False
        self.failed: str | None = None  # why the loop died, if it did
        self.slots: list[_Slot | None] = [None] * max_batch

    def submit(self, *requests: Request) -> None:
        """Queues the requests (all or none: QueueFullError past the queue, EngineStoppedError once stopping or
        failed)."""
        with self.wake:
            if self.stopping or self.failed:
                raise EngineStoppedError(self.failed or "the server is shutting down")
            waiting = sum(not r.cancelled.is_set() for r in self.waiting)
            if waiting + len(requests) > self.queue_size:
                raise QueueFullError(f"{waiting} requests are waiting for a slot and the queue holds {self.queue_size}")
            self.waiting.extend(requests)
            self.wake.notify()

    def stop(self) -> None:
        """Refuse new requests; `run` returns once every admitted and waiting request has finished."""
        with self.wake:
            self.stopping = True
            self.wake.notify()

    @property
    def busy(self) -> int:
        return sum(s is not None for s in self.slots) + len(self.waiting)

    def run(self) -> None:
        """The loop, until `stop` and every request has finished. A request whose admission fails (before its
        cache joins the batch: nothing shared is touched) ends alone with an error; a decode chunk that fails ends
        the requests of the batch, and the loop goes on with a new cache; a failure of the loop itself ends every
        request and marks the engine failed (`failed`: submit refuses, the server's /health says so)."""
        try:
            self._loop()
        except BaseException as e:
            self.failed = f"{type(e).__name__}: {e}"
            with self.wake:
                left = [*self.waiting, *(s.request for s in self.slots if s is not None)]
                self.waiting.clear()
            for request in left:
                request.emit(Finished("error", self.failed))
            raise

    def _loop(self) -> None:
        m = self.model
        batch = DecodeBatch.empty(m.config, self.max_batch, self.capacity)
        while True:
            with self.wake:
                while not self.waiting and not any(self.slots) and not self.stopping:
                    self.wake.wait()
                if self.stopping and not self.waiting and not any(self.slots):
                    return
                gone = [r for r in self.waiting if r.cancelled.is_set()]  # their clients left while they waited
                self.waiting = collections.deque(r for r in self.waiting if not r.cancelled.is_set())
                free = [i for i, s in enumerate(self.slots) if s is None]
                joining = [(row, self.waiting.popleft()) for row in free[: len(self.waiting)]]
            for request in gone:
                request.emit(Finished("cancelled"))
            for row, request in joining:
                try:
                    batch = self._admit(request, row, batch)
                except Exception as e:
                    request.emit(Finished("error", f"{type(e).__name__}: {e}"))
            active = [i for i, s in enumerate(self.slots) if s is not None]
            if not active:
                continue
            try:
                batch = self._chunk(batch, active)
            except Exception as e:  # the cache may have been donated to the step that failed
                for row in active:
                    self._finish(row, Finished("error", f"{type(e).__name__}: {e}"))
                batch = None  # freed before the new one is made
                self.prompts.clear()  # (a failure may be for want of memory)
                batch = DecodeBatch.empty(m.config, self.max_batch, self.capacity)

    def _admit(self, request: Request, row: int, batch: DecodeBatch) -> DecodeBatch:
        """Prefills a request alone and puts it in slot `row` (or finishes it at once for max_tokens 0); with
        prompt_logprobs the prefill scores the prompt too."""
        m = self.model
        if request.sampling.grammar is not None and request.guide is None:
            request.guide = m.guide(request.sampling.grammar)
        stream = TextStream(m.tokenizer, m.eos_ids, request.sampling.stop)
        if request.max_tokens == 0 and not request.prompt_logprobs:
            request.emit(Finished("length"))
            return batch
        s = request.sampling
        settings = RowSettings.of(s, s.seeds(1), m.config.vocab)  # checked before the join
        prefilled = self._prefilled(request)
        if prefilled.scored is not None:
            request.emit(_prompt_logprobs(prefilled.scored, request.logprobs))
        if request.max_tokens == 0:
            request.emit(Finished("length"))
            return batch
        batch = batch.join(row, prefilled, settings, request.guide)  # nothing after it fails
        self.slots[row] = _Slot(request, stream)
        return batch

    def _prefilled(self, request: Request) -> Prefilled:
        """A request's prompt prefilled alone: after the longest beginning a kept prompt shares with it (the same
        bits), else whole (with prompt_logprobs always whole: the pass scores every position); then kept."""
        m, ids = self.model, request.ids
        prefilled, reused = None, 0
        reusable = self.prompts.limit and request.cache_prompt and not request.prompt_logprobs
        found = self.prompts.longest(ids) if reusable else None  # a look-up marks its prompt recently used
        if found is not None:
            held, reused = found
            if reused == len(ids):
                prefilled = held
            else:
                prefilled = prefill_after(m.weights, m.config, held, reused, ids, self.capacity, m.native.active)
        if prefilled is None:
            top = TOP_LOGPROBS if request.prompt_logprobs else None
            prefilled, reused = prefill_row(m.weights, m.config, ids, self.capacity, m.native.active, top), 0
        if not request.cache_prompt:
            return prefilled
        self.prompts.record(reused)
        if self.prompts.limit:
            self.prompts.keep(dataclasses.replace(prefilled, scored=None))
        return prefilled

    def _chunk(self, batch: DecodeBatch, active: list[int]) -> DecodeBatch:
        """One device loop of the batch, then each active request's new tokens to its events; a request that
        ends leaves its row."""
        m = self.model
        top = TOP_LOGPROBS if any(self.slots[i].request.logprobs is not None for i in active) else None
        batch, tokens, lp = batch.advance(m.weights, m.config, m.native.active, top)  # [B, T]
        for row in active:
            self._deliver(row, self.slots[row], tokens[row], lp)
            if self.slots[row] is None:
                batch = batch.leave(row)
        return batch

    def _deliver(self, row: int, slot: _Slot, tokens: np.ndarray, lp: TokenLogprobs | None) -> None:
        request = slot.request
        for t, token in enumerate(tokens.tolist()):
            if request.cancelled.is_set():
                self._finish(row, Finished("cancelled"))
                return
            if request.guide is not None and request.guide.error:  # this token was not drawn under the grammar
                self._finish(row, Finished("error", f"constrained decoding failed: {request.guide.error}"))
                return
            text = slot.stream.add(token)
            slot.made += 1
            if request.logprobs is None:
                request.emit(Token(token, text))
            else:
                top = _top(lp.ids[row, t], lp.top[row, t], request.logprobs)
                request.emit(Token(token, text, float(lp.chosen[row, t]), top))
            if slot.stream.done:
                self._finish(row, Finished("stop", slot.stream.finish()))
                return
            if slot.made == request.max_tokens:
                self._finish(row, Finished("length", slot.stream.finish()))
                return

    def _finish(self, row: int, event: Finished) -> None:
        slot = self.slots[row]
        self.slots[row] = None
        slot.request.emit(event)


def _prompt_logprobs(scored: TokenLogprobs, k: int | None) -> PromptLogprobs:
    """A prompt's scored tokens [1, T-1] as its event: the first token has none, the others their k most likely
    (at least one)."""
    tops = (_top(ids, top, max(k or 0, 1)) for ids, top in zip(scored.ids[0], scored.top[0], strict=True))
    return PromptLogprobs((None, *scored.chosen[0].tolist()), ((), *tops))


def _top(ids: np.ndarray, logprobs: np.ndarray, k: int) -> tuple[tuple[int, float], ...]:
    """The k most likely tokens at a position [(id, logprob)], from its [TOP_LOGPROBS] ids and log-probabilities."""
    return tuple(zip(ids[:k].tolist(), logprobs[:k].tolist(), strict=True))
