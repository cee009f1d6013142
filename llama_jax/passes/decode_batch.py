"""The decode batch: rows of one KV cache, each a sequence with its own sampling settings, advanced CHUNK tokens
at a time by one jitted device loop (`decode_chunk`) that draws a token and feeds it back, with no trip to the host
between tokens. Generation (`generate.token_steps`) prefills its rows together and advances them to the end; the
server's engine joins a row prefilled alone into a free slot between chunks and lets it leave when done.

A row's numbers depend neither on the other rows (the batch-invariant kernels) nor on the attention window (each
row reads its own positions), so a sequence gets the same tokens and log-probabilities alone or among any others,
joined at the start or mid-flight. Draws follow the spec's sampler (`sampling`): a row's new token i uses
uniform(seed, i). A free row computes on, its output discarded, its length back at 0 before every chunk.

A row may be guided by a grammar (`text.grammar.Guide`): its next token is drawn from its logits with every token the
grammar does not allow at -inf (greedy: the allowed token of the largest logit; sampled: the spec's sampler over those
logits, so top-k and top-p count allowed tokens only). The mask is the host's (llguidance), so while a guided row is
live a chunk is one token, and its guide consumes that token before the next chunk. Its log-probabilities are the
model's own (of the logits before the mask), as vLLM reports them by default.

Where RoPE's frequencies change with a sequence's length (longrope past its original context: `switch_length`), a
row that grows past that length is computed again whole, its cache and logits replaced, as transformers' Phi-3
generation drops its cache there: the token that crosses is drawn from the short factors' logits, every later one
from the long factors' over the whole sequence. A chunk ends at that token, so the host holds each row's tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int, UInt32

from llama_jax.core.buckets import bucket, padded_block
from llama_jax.core.config import LlamaConfig
from llama_jax.core.kv_cache import KVCache
from llama_jax.core.sharding import shard_cache, to_host
from llama_jax.core.weights import Weights
from llama_jax.errors import InvalidArgumentError
from llama_jax.nn.invariant import log_softmax_last
from llama_jax.passes.cached import extend_stream, extend_unchecked, prefill
from llama_jax.passes.checks import check_tokens
from llama_jax.passes.sampling import Sampling, argmax_batch, sample_batch, width_for
from llama_jax.passes.score import logprobs_of_stream
from llama_jax.runtime.executables import persistent_jit
from llama_jax.text.grammar import Guide

CHUNK = 8  # new tokens per device loop: streaming sees them CHUNK at a time
# how decode_chunk is jitted (the tests count its traces under the same options)
DECODE_JIT = {
    "static_argnames": ("config", "steps", "width", "greedy", "native", "window", "logprobs"),
    "donate_argnames": ("cache",),
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowSettings:
    """Each row's sampling [B]: temperature (0: greedy), top_k (0: the whole vocabulary), top_p and seed; numpy on
    the host, where a chunk reads which rows are greedy and a row's settings are set when it joins."""

    temperature: Float[Array | np.ndarray, " B"]
    top_k: Int[Array | np.ndarray, " B"]
    top_p: Float[Array | np.ndarray, " B"]
    seed: UInt32[Array | np.ndarray, " B"]

    @classmethod
    def of(cls, sampling: Sampling, seeds: np.ndarray, vocab: int) -> RowSettings:
        """A row per seed [B] with the sampling's settings (a top_k past the vocabulary keeps all of it, as 0)."""
        rows = len(seeds)
        return cls(
            np.full(rows, sampling.temperature, np.float32),
            np.full(rows, min(sampling.top_k or 0, vocab), np.int32),
            np.full(rows, sampling.top_p, np.float32),
            np.asarray(seeds, np.uint32),
        )

    def with_row(self, row: int, other: RowSettings) -> RowSettings:
        """These settings with row `row` replaced by other's only row."""
        return jax.tree.map(lambda mine, theirs: np.concatenate([mine[:row], theirs, mine[row + 1 :]]), self, other)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Of each token [B, T] (drawn, or a prompt's scored): its log-probability under the model (chosen: its logits
    before temperature), and the most likely tokens there with theirs (ids, top: [B, T, k], the most likely first,
    ties by lower id)."""

    chosen: Float[Array | np.ndarray, "B T"]
    ids: Int[Array | np.ndarray, "B T K"]
    top: Float[Array | np.ndarray, "B T K"]


@dataclasses.dataclass(frozen=True)
class Prefilled:
    """A prompt prefilled alone, to join a batch: its cache (of its length bucket), the logits after it [1, V], its
    ids [length], and when asked its tokens scored (each after the ones before it: [1, length - 1])."""

    cache: KVCache
    logits: Float[Array, "1 V"]
    ids: np.ndarray
    scored: TokenLogprobs | None

    @property
    def length(self) -> int:
        return self.ids.size


@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """The device state of the rows (cache, the logits each row draws its next token from) and the host's (each
    row's settings, its positions written, 0 for a free row, its tokens drawn, the counter of its draws, and its
    ids, prompt and drawn tokens, for a row computed again where its RoPE changes: `switch_length`).
    width: how many candidates a sampled chunk sorts, decided when the batch is made (`width_for`): the largest
    top_k of the rows it is made with, or where rows of any top_k may join later the whole vocabulary (one
    compiled loop for all of them). Any width at least a row's top_k gives that row the same draws."""

    cache: KVCache
    logits: Float[Array, "B V"]
    settings: RowSettings
    written: np.ndarray
    drawn: np.ndarray
    width: int
    ids: tuple[np.ndarray, ...]
    guides: tuple[Guide | None, ...]

    @classmethod
    def empty(cls, config: LlamaConfig, rows: int, capacity: int) -> DecodeBatch:
        """Free rows of `capacity` positions each (the sliding window's only, where that is shorter:
        `KVCache.for_positions`), for rows that `join` later (any top_k: the whole vocabulary)."""
        settings = RowSettings.of(Sampling(), np.zeros(rows, np.uint32), config.vocab)
        logits = jnp.zeros((rows, config.vocab), jnp.float32)  # [B, V]
        free = np.zeros(rows, np.int32)  # [B]
        cache = KVCache.for_positions(config, rows, capacity)
        ids = (np.zeros(0, np.int64),) * rows
        return cls(cache, logits, settings, free, free.copy(), config.vocab, ids, (None,) * rows)

    @classmethod
    def prefill(
        cls,
        weights: Weights,
        config: LlamaConfig,
        prompts: Sequence[np.ndarray],
        capacity: int,
        settings: RowSettings,
        native: bool = False,
        mesh: Mesh | None = None,
        guides: Sequence[Guide | None] | None = None,
    ) -> DecodeBatch:
        """A row per prompt, prefilled together (each padded to the longest's bucket) in a cache for `capacity`
        positions (the sliding window's only, where that is shorter: `KVCache.for_positions`), split over the
        mesh like the (sharded) weights; the width their top_k need; guides: each row's grammar's (None: free)."""
        lengths = [p.size for p in prompts]
        block = padded_block(prompts, bucket(max(lengths), capacity))  # [B, T]
        cache = KVCache.for_positions(config, len(prompts), capacity)
        cache = cache if mesh is None else shard_cache(cache, config, mesh)
        logits, cache = prefill(weights, cache, block, config, n=lengths, native=native)
        written = np.asarray(lengths, np.int32)
        width = width_for(settings.top_k.tolist(), config.vocab)
        ids = tuple(np.asarray(p, np.int64) for p in prompts)
        guides = (None,) * len(prompts) if guides is None else tuple(guides)
        if len(guides) != len(prompts):
            raise InvalidArgumentError(f"{len(guides)} guides for {len(prompts)} prompts; give one per prompt")
        return cls(cache, logits, settings, written, np.zeros_like(written), width, ids, guides)

    @property
    def capacity(self) -> int:
        return self.cache.capacity

    @property
    def guided(self) -> bool:
        """Whether a live row is guided by a grammar whose text goes on (not done nor failed): its chunks are then
        one token."""
        return any(
            g is not None and w > 0 and not g.done and g.error is None
            for g, w in zip(self.guides, self.written, strict=True)
        )

    def steps(self, config: LlamaConfig) -> int:
        """The tokens the next chunk draws: CHUNK (1 while a live row is `guided`), unless the longest row's room
        ends first (`KVCache.room`) or a row's length crosses where its RoPE changes (`switch_length`: the chunk ends
        with the token that crosses)."""
        room = self.cache.room(int(self.written.max()))
        most = 1 if self.guided else CHUNK
        steps = most if room is None else min(most, room)
        switch = config.rope.switch_length
        below = [] if switch is None else self.written[(self.written > 0) & (self.written <= switch)]  # live rows
        return min(steps, switch + 1 - int(max(below))) if len(below) else steps

    def join(self, row: int, prefilled: Prefilled, settings: RowSettings, guide: Guide | None = None) -> DecodeBatch:
        """The batch with a prompt prefilled alone in (free) row `row`, with its settings (one row) and its
        grammar's guide (None: free). This batch's cache is spent (written in place, as `advance` writes it): go on
        with the batch returned."""
        needs = width_for(settings.top_k.tolist(), self.logits.shape[1])
        if needs > self.width:
            raise InvalidArgumentError(f"a row that sorts {needs} candidates joins a batch that sorts {self.width}")
        cache, logits = _join(self.cache, self.logits, prefilled.cache, prefilled.logits, jnp.int32(row))
        written, drawn = self.written.copy(), self.drawn.copy()
        written[row], drawn[row] = prefilled.length, 0
        ids = _replaced(self.ids, row, prefilled.ids)
        guides = (*self.guides[:row], guide, *self.guides[row + 1 :])
        settings = self.settings.with_row(row, settings)
        return DecodeBatch(cache, logits, settings, written, drawn, self.width, ids, guides)

    def leave(self, row: int) -> DecodeBatch:
        """The batch with row `row` free."""
        written = self.written.copy()
        written[row] = 0
        ids = _replaced(self.ids, row, np.zeros(0, np.int64))
        guides = (*self.guides[:row], None, *self.guides[row + 1 :])
        return dataclasses.replace(self, written=written, ids=ids, guides=guides)

    def advance(
        self, weights: Weights, config: LlamaConfig, native: bool = False, logprobs: int | None = None
    ) -> tuple[DecodeBatch, np.ndarray, TokenLogprobs | None]:
        """A chunk of new tokens for every row: CHUNK, unless the longest row's room ends first. Returns the
        batch after it, the tokens [B, T] (a free row's are not its own) and with logprobs (how many of the most
        likely tokens beside each drawn one) their log-probabilities (`TokenLogprobs`), on the host. A guided row's
        guide consumes its token."""
        live = self.written > 0  # [B]: a row holds its prompt's tokens at least
        steps = self.steps(config)
        allowed = self._allowed(live)
        window = self.cache.attention_window(int(self.written.max()), steps)
        greedy = bool(np.all(self.settings.temperature[live] == 0))
        cache = self.cache
        if not live.all():  # free rows back to length 0 (the loop moves every row on)
            cache = self.cache.with_length(jnp.asarray(self.written))
        out, logits, cache, lp = decode_chunk(
            weights, cache, self.logits, self.settings, jnp.asarray(self.drawn), config=config, steps=steps,
            width=1 if greedy else self.width, greedy=greedy, native=native, window=window, logprobs=logprobs,
            allowed=allowed,
        )  # fmt: skip
        moved = np.where(live, steps, 0).astype(np.int32)  # [B]
        out = to_host(out)  # [B, T]
        for b, guide in enumerate(self.guides):
            if guide is not None and live[b]:
                guide.consume(out[b, 0])  # a guided chunk is one token
        ids = tuple(np.concatenate([mine, out[b]]) if live[b] else mine for b, mine in enumerate(self.ids))
        after = dataclasses.replace(
            self, cache=cache, logits=logits, written=self.written + moved, drawn=self.drawn + moved, ids=ids
        )
        switch = config.rope.switch_length
        crossed = [] if switch is None else np.flatnonzero(live & (self.written <= switch) & (after.written > switch))
        for row in crossed:
            after = after._computed_again(weights, config, int(row), native)
        return after, out, None if lp is None else jax.tree.map(to_host, lp)

    def _allowed(self, live: np.ndarray) -> Int[Array, "B W"] | None:
        """Each row's mask of the tokens it may draw next [B, W] (int32 words of 32 ids; every bit set for a free
        row), where a live row is guided; else None."""
        if not self.guided:
            return None
        words = -(-self.logits.shape[1] // 32)
        masks = np.full((len(self.guides), words), -1, np.int32)  # [B, W]
        for b, guide in enumerate(self.guides):
            if guide is not None and live[b]:
                guide.fill(masks[b])
        return jnp.asarray(masks)

    def _computed_again(self, weights: Weights, config: LlamaConfig, row: int, native: bool) -> DecodeBatch:
        """The batch with row `row`'s cache and logits those of its whole sequence prefilled alone (its draws and
        settings kept): where its length has just crossed its RoPE's `switch_length`."""
        again = prefill_row(weights, config, self.ids[row], self.capacity, native)
        cache, logits = _join(self.cache, self.logits, again.cache, again.logits, jnp.int32(row))
        return dataclasses.replace(self, cache=cache, logits=logits)


def _replaced(rows: tuple[np.ndarray, ...], row: int, ids: np.ndarray) -> tuple[np.ndarray, ...]:
    """Each row's ids, row `row`'s replaced."""
    return (*rows[:row], np.asarray(ids, np.int64), *rows[row + 1 :])


def prefill_row(
    weights: Weights,
    config: LlamaConfig,
    ids: Sequence[int],
    capacity: int,
    native: bool = False,
    scored_top: int | None = None,
) -> Prefilled:
    """A prompt prefilled alone in a cache of its length bucket (at most `capacity`): the computation a
    generation runs for it. With scored_top, the same pass also scores the prompt's tokens (with the scored_top
    most likely at each position) in the bits `Model.score` gives them: the layers run once."""
    n = len(ids)
    if n < 1:
        raise InvalidArgumentError("the prompt is empty; generation needs at least one token to start from")
    length = bucket(n, capacity)
    block = padded_block([ids], length)  # [1, T]
    cache = KVCache.for_positions(config, 1, length)  # a ring where the batch's rows are
    if scored_top is None:
        logits, cache = prefill(weights, cache, block, config, n=[n], native=native)
        return Prefilled(cache, logits, np.asarray(ids, np.int64), None)
    check_tokens(block, config.vocab)
    count = jnp.asarray([n], jnp.int32)
    logits, cache, scored = _prefill_scored(weights, cache, jnp.asarray(block), count, config, native, scored_top)
    scored = jax.tree.map(lambda a: np.asarray(a)[:, : n - 1], scored)  # [1, n-1, ...]: the prompt's tokens
    return Prefilled(cache, logits, np.asarray(ids, np.int64), scored)


def reuses_prefixes(config: LlamaConfig) -> bool:
    """Whether a prompt's first positions can be taken from another prompt's prefill (`prefill_after`): where its
    cache holds every position (no sliding-window ring) and its RoPE does not change with the length."""
    return config.sliding_window is None and config.rope.switch_length is None


def prefill_after(
    weights: Weights,
    config: LlamaConfig,
    held: Prefilled,
    kept: int,
    ids: Sequence[int],
    capacity: int,
    native: bool = False,
) -> Prefilled | None:
    """A prompt prefilled after the first `kept` of its positions, taken from `held` (a prompt prefilled earlier,
    whose first kept ids are these): held's first kept slots in a cache of their own, then the rest of the prompt
    as one block after them (padded to its bucket). The same bits as `prefill_row(ids)` (its logits, and its
    cache's first len(ids) slots): every position's keys and values are computed by the same products whatever the
    block holds (the batch-invariant kernels), and attention does not depend on the window it reads. None where the
    rest's bucket does not fit after them in `capacity` slots (the caller prefills it whole)."""
    n = len(ids)
    if not reuses_prefixes(config):
        raise InvalidArgumentError(f"a {config.family} model's prompts cannot reuse another's prefill")
    if not 0 < kept < n or kept > held.length or not np.array_equal(held.ids[:kept], np.asarray(ids[:kept])):
        raise InvalidArgumentError(f"the held prompt does not begin with the first {kept} of these {n} ids")
    block = bucket(n - kept)
    slots = bucket(kept + block, capacity)
    if kept + block > slots:
        return None
    cache = _first_slots(held.cache, jnp.int32(kept), slots)
    logits, cache = prefill(weights, cache, padded_block([ids[kept:]], block), config, n=[n - kept], native=native)
    return Prefilled(cache, logits, np.asarray(ids, np.int64), None)


@functools.partial(jax.jit, static_argnames="slots")
def _first_slots(held: KVCache, kept: Int[Array, ""], slots: int) -> KVCache:
    """A one-row cache of `slots` slots holding held's first `kept` positions (the rest zeros), its length kept."""

    def first(a: Float[Array, "L 1 K S H"]) -> Float[Array, "L 1 K slots H"]:
        a = a[:, :, :, :slots]
        a = jnp.pad(a, ((0, 0), (0, 0), (0, 0), (0, slots - a.shape[3]), (0, 0)))
        return jnp.where(jnp.arange(slots)[None, None, None, :, None] < kept, a, 0)

    return KVCache(first(held.k), first(held.v), jnp.full((1,), kept, jnp.int32))


@persistent_jit(static_argnames=("config", "native", "top"), donate_argnames=("cache",))
def _prefill_scored(
    weights: Weights,
    cache: KVCache,
    tokens: Int[Array, "1 T"],
    n: Int[Array, " 1"],
    config: LlamaConfig,
    native: bool,
    top: int,
) -> tuple[Float[Array, "1 V"], KVCache, TokenLogprobs]:
    """`prefill` of an empty cache of T slots (its logits after the last real token and the cache, the same
    bits: `extend_unchecked`'s pass) and, from the same layers' output, each position's log-probability of the
    next token with the `top` most likely there: `score.every_logprob`'s head, in its bits (the layers' output
    is the same with the cache as without: the same keys, T slots, the same causal mask)."""
    # x [1, T, D]: the last layer's output, the same bits `score.every_logprob` gets from its pass without a cache
    x, logits, cache = extend_stream(weights, cache, tokens, n, config, native, tokens.shape[1])
    rows = logprobs_of_stream(weights, x, tokens, config, native)[0]  # [T-1, V]
    chosen = jnp.take_along_axis(rows, tokens[0, 1:, None], axis=1)[:, 0]  # [T-1]
    top_lp, top_ids = lax.top_k(rows, top)  # [T-1, top] each
    scored = TokenLogprobs(chosen[None], top_ids[None], top_lp[None])  # [1, T-1, ...]
    return logits, cache, scored


@functools.partial(jax.jit, donate_argnames=("cache", "logits"))
def _join(
    cache: KVCache, logits: Float[Array, "B V"], small: KVCache, after: Float[Array, "1 V"], row: Int[Array, ""]
) -> tuple[KVCache, Float[Array, "B V"]]:
    """The batch's cache and logits with row `row` replaced by a prompt's own prefilled cache (its first slots:
    a linear cache's positions, or a ring's, whose slots are the batch's ring's) and its logits after the
    prompt. The batch's cache and logits are donated: written in place, where a copy of the whole cache cost 220 ms
    a join at 8 rows of 2048 positions (SmolLM2-135M, 755 MB of keys and values; Intel Xeon family 6 model 167)."""
    at = (0, row, 0, 0, 0)  # [L, B, K, S, H]
    k = lax.dynamic_update_slice(cache.k, small.k.astype(cache.k.dtype), at)  # [L, B, K, S, H]
    v = lax.dynamic_update_slice(cache.v, small.v.astype(cache.v.dtype), at)  # [L, B, K, S, H]
    joined = dataclasses.replace(cache, k=k, v=v, length=cache.length.at[row].set(small.length[0]))
    return joined, logits.at[row].set(after[0])


@persistent_jit(**DECODE_JIT)
def decode_chunk(
    weights: Weights,
    cache: KVCache,
    logits: Float[Array, "B V"],
    settings: RowSettings,
    drawn: Int[Array, " B"],
    config: LlamaConfig,
    steps: int,
    width: int,
    greedy: bool,
    native: bool = False,
    window: int | None = None,
    logprobs: int | None = None,
    allowed: Int[Array, "B W"] | None = None,
) -> tuple[Int[Array, "B T"], Float[Array, "B V"], KVCache, TokenLogprobs | None]:
    """steps new tokens per row on the device: row b's token drawn[b]+i (drawn[b]: its draws before this chunk)
    drawn from the logits (argmax when greedy, else the spec's sampler over `width` candidates with
    uniform(seed[b], drawn[b]+i)) and fed back
    through the layers. Returns the tokens, the logits after the last one, the cache, and with logprobs (static:
    how many of the most likely tokens to give beside each drawn one, 0 for none) `TokenLogprobs`; else None. The
    caller has checked that steps more slots fit, inside the attention window. native: the native kernels.
    allowed: each row's mask of the tokens it may draw [B, ceil(V/32)] (bit i % 32 of word i // 32: token i), the
    others' logits at -inf for the draw only; with it, steps is 1 (the next token's mask is the host's)."""
    batch = logits.shape[0]
    top = max(logprobs or 0, 1)
    if allowed is not None and steps != 1:
        raise InvalidArgumentError(f"a masked chunk draws one token (the next mask is the host's), not {steps}")

    def step(i, carry):
        cache, logits, out, lp = carry
        n = drawn + i  # [B]: the index of this draw
        choices = logits if allowed is None else masked(logits, allowed)  # [B, V]
        if greedy:
            ids = argmax_batch(choices)  # [B]
        else:
            s = settings
            ids = sample_batch(choices, s.temperature, s.top_k, s.top_p, s.seed, n, width)  # [B]
        if logprobs is not None:
            rows = log_softmax_last(logits)  # [B, V]: each row alone
            top_lp, top_ids = lax.top_k(rows, top)  # [B, top] each
            chosen = jnp.take_along_axis(rows, ids[:, None], axis=1)[:, 0]  # [B]
            lp = TokenLogprobs(
                lp.chosen.at[:, i].set(chosen), lp.ids.at[:, i].set(top_ids), lp.top.at[:, i].set(top_lp)
            )
        ones = jnp.ones(batch, jnp.int32)
        logits, cache = extend_unchecked(weights, cache, ids[:, None], ones, config, native, window)  # [B, V]
        return cache, logits, out.at[:, i].set(ids), lp

    lp = None
    if logprobs is not None:
        lp = TokenLogprobs(
            jnp.zeros((batch, steps)), jnp.zeros((batch, steps, top), jnp.int32), jnp.zeros((batch, steps, top))
        )
    carry = (cache, logits, jnp.zeros((batch, steps), jnp.int32), lp)
    cache, logits, out, lp = lax.fori_loop(0, steps, step, carry)
    return out, logits, cache, lp


def masked(logits: Float[Array, "B V"], allowed: Int[Array, "B W"]) -> Float[Array, "B V"]:
    """The logits with each token its row's mask does not allow at -inf (bit i % 32 of word i // 32: token i); a
    row's allowed logits unchanged, bit for bit."""
    ids = jnp.arange(logits.shape[1])
    bits = (allowed[:, ids // 32] >> (ids % 32)) & 1  # [B, V]
    return jnp.where(bits == 1, logits, -jnp.inf)
