"""Continuous batching for the server: requests join a running decode batch at chunk boundaries and leave when
done, and each gets exactly the tokens and log-probabilities it would get alone.

The batch is `max_batch` slots, the rows of one KV cache of `capacity` positions. A request joins by being
prefilled alone (its prompt in a cache of its length bucket: the computation `Model.complete` runs for it), its
keys and values copied into a free slot's row; then it decodes with the others, up to CHUNK tokens a device loop
(`decode_chunk`: each row with its own settings, seed and token count). A sequence's numbers do not depend on the
other rows (the batch-invariant kernels) nor on the attention window (each row reads its own positions), so its
text and log-probabilities are the same alone or among any others. The rows of empty slots compute on, their
output discarded, their length reset at every chunk.

One thread (`Engine.run`) does all the device work, in order; the server's threads only `submit` requests and
read their events. A request that is cancelled (its client went away) leaves its slot at the next chunk.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from llama_jax.core.buckets import bucket, padded_block
from llama_jax.core.kv_cache import KVCache
from llama_jax.errors import LlamaJaxError
from llama_jax.model import Model
from llama_jax.passes.cached import attention_window, prefill
from llama_jax.passes.generate import CHUNK, decode_chunk
from llama_jax.passes.sampling import Sampling
from llama_jax.passes.score import every_logprob
from llama_jax.serve.protocol import TOP_LOGPROBS
from llama_jax.text.detokenize import TextStream


class QueueFullError(LlamaJaxError):
    """More requests waiting than the engine's queue holds: the server answers 429, retry later."""


class EngineStoppedError(LlamaJaxError):
    """The engine takes no more requests (shutting down, or its loop failed): the server answers 503."""


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
    log-probabilities each token reports (None: no log-probabilities), whether to score the prompt too, and where
    its events go (emit: called from the engine's thread, in order). cancel() frees its slot at the next chunk."""

    ids: list[int]
    max_tokens: int
    sampling: Sampling
    emit: Callable[[Event], None]
    logprobs: int | None = None
    prompt_logprobs: bool = False
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()


@dataclasses.dataclass
class _Slot:
    request: Request
    stream: TextStream
    made: int = 0  # new tokens so far


@functools.partial(jax.jit, donate_argnames=("cache", "logits"))
def _join(cache: KVCache, logits, small: KVCache, first_logits, row):
    """The batch's cache and logits with row `row` replaced by a request's own prefilled cache (its first S slots)
    and its logits after the prompt."""
    at = (0, row, 0, 0, 0)  # [L, B, K, S, H]
    k = lax.dynamic_update_slice(cache.k, small.k.astype(cache.k.dtype), at)
    v = lax.dynamic_update_slice(cache.v, small.v.astype(cache.v.dtype), at)
    return KVCache(k, v, cache.length.at[row].set(small.length[0])), logits.at[row].set(first_logits[0])


@functools.partial(jax.jit, static_argnames=("config", "top", "native"))
def _prompt_logprobs(weights, tokens, config, top: int, native: bool):
    """Of a [1, T] block: each position's log-probability of the next token (the bits `Model.score` gives it) and
    the `top` most likely there."""
    rows = every_logprob(weights, tokens, config, native)[0]  # [T-1, V]
    chosen = jnp.take_along_axis(rows, tokens[0, 1:, None], axis=1)[:, 0]  # [T-1]
    top_lp, top_ids = lax.top_k(rows, top)  # [T-1, top]
    return chosen, top_ids, top_lp


class Engine:
    """The decode batch of a model: `submit` requests (from any thread), `run` the loop (in one thread) until
    `stop`. max_batch: the slots; capacity: the positions of a slot (a request's prompt and new tokens must fit);
    queue: how many requests may wait for a slot before `submit` refuses (QueueFullError)."""

    def __init__(self, model: Model, max_batch: int = 8, capacity: int = 2048, queue: int = 64):
        self.model, self.max_batch, self.capacity, self.queue_size = model, max_batch, capacity, queue
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
        c, b = self.model.config, self.max_batch
        cache = KVCache.empty(c, b, self.capacity)
        logits = jnp.zeros((b, c.vocab), jnp.float32)
        settings = {
            "temperature": np.zeros(b, np.float32),
            "top_k": np.zeros(b, np.int32),
            "top_p": np.ones(b, np.float32),
            "seeds": np.zeros(b, np.uint32),
        }
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
                    cache, logits = self._admit(request, row, cache, logits, settings)
                except Exception as e:
                    request.emit(Finished("error", f"{type(e).__name__}: {e}"))
            active = [i for i, s in enumerate(self.slots) if s is not None]
            if not active:
                continue
            try:
                cache, logits = self._chunk(cache, logits, settings, active)
            except Exception as e:  # the cache may have been donated to the step that failed
                for row in active:
                    self._finish(row, Finished("error", f"{type(e).__name__}: {e}"))
                cache = logits = None  # freed before the new ones are made
                cache = KVCache.empty(c, b, self.capacity)
                logits = jnp.zeros((b, c.vocab), jnp.float32)

    def _admit(self, request: Request, row: int, cache, logits, settings):
        """Prefills a request alone and puts it in slot `row` (or finishes it at once for max_tokens 0)."""
        m = self.model
        if request.prompt_logprobs:
            request.emit(self._score_prompt(request))
        stream = TextStream(m.tokenizer, m.eos_ids, request.sampling.stop)
        if request.max_tokens == 0:
            request.emit(Finished("length"))
            return cache, logits
        n = len(request.ids)
        length = bucket(n, self.capacity)
        block = padded_block([request.ids], length)  # [1, T]
        s = request.sampling
        values = (s.temperature, min(s.top_k or 0, m.config.vocab), s.top_p, s.seeds(1)[0])  # checked before the join
        first, small = prefill(
            m.weights, KVCache.empty(m.config, 1, length), block, m.config, n=[n], native=m.native.active
        )
        cache, logits = _join(cache, logits, small, first, jnp.int32(row))  # nothing after it fails
        for name, value in zip(("temperature", "top_k", "top_p", "seeds"), values, strict=True):
            settings[name][row] = value
        self.slots[row] = _Slot(request, stream)
        return cache, logits

    def _score_prompt(self, request: Request) -> PromptLogprobs:
        m, ids = self.model, request.ids
        if len(ids) < 2:
            return PromptLogprobs((None,), ((),))
        block = jnp.asarray(padded_block([ids], bucket(len(ids), self.capacity)))  # [1, T]: right padding
        scored = _prompt_logprobs(m.weights, block, m.config, TOP_LOGPROBS, m.native.active)
        chosen, top_ids, top_lp = (np.asarray(a)[: len(ids) - 1] for a in scored)
        k = max(request.logprobs or 0, 1)
        tops = tuple(
            tuple(zip(top_ids[t, :k].tolist(), top_lp[t, :k].tolist(), strict=True)) for t in range(len(ids) - 1)
        )
        return PromptLogprobs((None, *chosen.tolist()), ((), *tops))

    def _chunk(self, cache: KVCache, logits, settings, active: list[int]):
        """One device loop of the batch, then each active request's new tokens to its events."""
        c = self.model.config
        slots = [self.slots[i] for i in active]
        lengths = np.zeros(self.max_batch, np.int32)
        for i, s in zip(active, slots, strict=True):
            lengths[i] = len(s.request.ids) + s.made
        steps = min(CHUNK, self.capacity - int(lengths.max()))
        made = np.zeros(self.max_batch, np.int32)
        for i, s in zip(active, slots, strict=True):
            made[i] = s.made
        cache = KVCache(cache.k, cache.v, jnp.asarray(lengths))  # empty slots back to length 0
        greedy = all(s.request.sampling.greedy for s in slots)
        top = TOP_LOGPROBS if any(s.request.logprobs is not None for s in slots) else None
        window = attention_window(int(lengths.max()), steps, self.capacity)
        out, logits, cache, lp = decode_chunk(
            self.model.weights, cache, logits, jnp.asarray(settings["temperature"]), jnp.asarray(settings["top_k"]),
            jnp.asarray(settings["top_p"]), jnp.asarray(settings["seeds"]), jnp.asarray(made),
            config=c, steps=steps, width=1 if greedy else c.vocab, greedy=greedy, native=self.model.native.active,
            window=window, logprobs=top,
        )  # fmt: skip
        out = np.asarray(out)
        lp = None if lp is None else jax.tree.map(np.asarray, lp)
        for i, s in zip(active, slots, strict=True):
            self._deliver(i, s, out[i], lp)
        return cache, logits

    def _deliver(self, row: int, slot: _Slot, tokens: np.ndarray, lp) -> None:
        request = slot.request
        for t, token in enumerate(tokens.tolist()):
            if request.cancelled.is_set():
                self._finish(row, Finished("cancelled"))
                return
            text = slot.stream.add(token)
            slot.made += 1
            if request.logprobs is None:
                request.emit(Token(token, text))
            else:
                k = request.logprobs
                top = tuple(zip(lp.ids[row, t, :k].tolist(), lp.top[row, t, :k].tolist(), strict=True))
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
