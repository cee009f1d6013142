"""The spec's seeded sampler ("Sampling" in main.bend), bit for bit: temperature, top-k and top-p in a fixed F32
order, drawn with a counter-based hash instead of a stateful generator.

The draw: `uniform(seed, n)` is the top 24 bits of hash32(hash32(seed) + n) times 2^-24, where hash32 is Chris
Wellons' lowbias32. New token i (0-based) of a sequence with seed s uses uniform(s, i); nothing is kept between
draws, so a seed gives the same draws whatever ran before. JAX's threefry keys are not used.

The sample, in the spec's order: the k largest logits, ties with the lower id first; weights
w = exp(v/temp - top/temp) (top: the largest); Z their left-to-right sum; top-p keeps each candidate whose
cumulative weight before it is below p·Z (the first always kept), Zp their sum; the draw is the first kept
candidate whose cumulative weight exceeds u·Zp (the last kept one if rounding leaves none). The cumulative
weights are one left fold (`lax.scan`): `jnp.cumsum`'s summation order is not a left fold.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, Float, Int, UInt32

from llama_jax.errors import InvalidArgumentError, SamplingError
from llama_jax.text.grammar import Grammar

SEEDS = 2**32  # seeds are the spec's U32


def hash32(x: UInt32[Array, "*B"] | int) -> UInt32[Array, "*B"]:
    """lowbias32: xor-shifts and two odd multipliers, a bijection on uint32 (wrapping arithmetic)."""
    x = jnp.asarray(x, dtype=jnp.uint32)
    x = x ^ (x >> 16)
    x = x * jnp.uint32(2146121005)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(2221713035)
    return x ^ (x >> 16)


def uniform(seed: UInt32[Array, "*B"] | int, n: UInt32[Array, "*B"] | int) -> Float[Array, "*B"]:
    """Draw n of a seed: a float32 in [0, 1), a multiple of 2^-24 (exact)."""
    bits = hash32(hash32(seed) + jnp.asarray(n, dtype=jnp.uint32)) >> 8
    return bits.astype(jnp.float32) * jnp.float32(2.0**-24)


def _sample_row(
    logits: Float[Array, " V"],
    temperature: Float[Array, ""],
    top_k: Int[Array, ""],
    top_p: Float[Array, ""],
    u: Float[Array, ""],
    width: int,
) -> Int[Array, ""]:
    """One draw; width (static) ≥ every row's top_k: the candidates sorted, of which the first top_k count."""
    canonical = jnp.where(logits == 0, jnp.float32(0), logits)  # -0.0 ties +0.0, as F32 comparison says
    values, ids = lax.top_k(canonical, width)  # [width], largest first, ties by lower id
    count = jnp.where((top_k <= 0) | (top_k > width), width, top_k)
    top = values[0]
    # a barrier keeps XLA from rewriting v / t as v * (1/t) (not the same float) when t is broadcast
    divisor = lax.optimization_barrier(jnp.broadcast_to(temperature, values.shape))  # [width]
    weights = jnp.exp(values / divisor - top / temperature)  # [width]
    weights = jnp.where(jnp.arange(width) < count, weights, jnp.float32(0))  # adding 0 leaves a sum unchanged

    def add(acc, w):
        acc = acc + w
        return acc, acc

    z, cumulative = lax.scan(add, jnp.float32(0), weights, unroll=8)  # the left fold, [width]
    limit = top_p * z
    before = jnp.concatenate([jnp.zeros(1, jnp.float32), cumulative[:-1]])  # weight before each candidate
    position = jnp.arange(width)
    kept = jnp.sum((position == 0) | ((before < limit) & (position < count)))  # a prefix: before only grows
    target = u * cumulative[kept - 1]
    stops = (position == kept - 1) | (target < cumulative)
    pick = jnp.argmax(stops & (position < kept))
    greedy = jnp.argmax(logits)  # temperature 0: the first index of the maximum
    return jnp.where(temperature == 0, greedy, ids[pick]).astype(jnp.int32)


_sample_one = jax.jit(_sample_row, static_argnames="width")


@functools.partial(jax.jit, static_argnames=("width",))
def sample_batch(
    logits: Float[Array, "B V"],
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
    seeds: UInt32[Array, " B"],
    n: Int[Array, " B"],
    width: int,
) -> Int[Array, " B"]:
    """A draw per row with its own settings and the uniform(seeds[b], n[b]); width (static): the number of
    candidates sorted, at least the largest top_k (the vocabulary when a row has none). Values are not checked
    here: `check_settings` does it on the host."""
    u = uniform(seeds, n)
    return jax.vmap(functools.partial(_sample_row, width=width))(logits, temperature, top_k, top_p, u)


ARGMAX_BLOCK = 128  # logits a block (argmax_batch): 64 and 512 measured twice as slow on a Zen 4


@jax.jit
def argmax_batch(logits: Float[Array, "B V"]) -> Int[Array, " B"]:
    """Greedy: the first index of each row's maximum (the spec's argmax; a NaN counts as the maximum, as in
    jnp.argmax). In two steps: each block of ARGMAX_BLOCK logits' maximum, then the first index of the row's in the
    first block that holds it. XLA CPU computes an argmax as a scalar loop over (value, index) pairs: over 49152
    logits 0.22 ms, 3% of a batch-1 decode step on a Zen 4, where the blocks' maxima vectorize (5.8x faster at batch
    1, 6.6x at batch 8, with the NaN check)."""
    b, v = logits.shape
    n = -(-v // ARGMAX_BLOCK)
    pad = ((0, 0), (0, n * ARGMAX_BLOCK - v))
    blocks = jnp.pad(logits, pad, constant_values=-jnp.inf).reshape(b, n, ARGMAX_BLOCK)  # [B, n, K]
    nan = jnp.max(jnp.where(jnp.isnan(blocks), 1.0, 0.0), axis=-1) > 0  # [B, n] (XLA CPU's max drops a NaN)
    tops = jnp.where(nan, jnp.nan, jnp.max(blocks, axis=-1))  # [B, n]
    block = jnp.argmax(tops, axis=-1)  # [B]
    within = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [B, K]
    return (block * ARGMAX_BLOCK + jnp.argmax(within, axis=-1)).astype(jnp.int32)  # [B]


def check_settings(temperature: float, top_k: int | None, top_p: float, vocab: int) -> None:
    """SamplingError for settings the sampler does not define."""
    if not (isinstance(temperature, int | float) and np.isfinite(temperature) and temperature >= 0):
        raise SamplingError(f"temperature must be a finite number ≥ 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int | np.integer) or top_k < 0):
        raise SamplingError(f"top_k must be None or an integer ≥ 0 (None or 0: the whole vocabulary), got {top_k!r}")
    if not (isinstance(top_p, int | float) and 0 < top_p <= 1):
        raise SamplingError(f"top_p must lie in (0, 1] (1: keep all), got {top_p!r}")
    if vocab < 1:
        raise SamplingError("cannot sample from an empty set of logits")


def width_for(top_ks: list[int | None], vocab: int) -> int:
    """How many candidates a batch must sort: its largest top_k, or the vocabulary if any row keeps all."""
    if any(k is None or k == 0 or k >= vocab for k in top_ks):
        return vocab
    return max(int(k) for k in top_ks)


def sample(logits, temperature: float, top_k: int | None, top_p: float, u: float) -> int:
    """One id drawn from one row of logits by u in [0, 1) (the spec's `sample`; u is usually `uniform(seed, n)`);
    temperature 0 is greedy; top_k None or 0 keeps the whole vocabulary. Checks every argument (SamplingError)."""
    row = np.asarray(logits, dtype=np.float32)
    if row.ndim != 1:
        raise SamplingError(f"sample takes one row of logits, got shape {row.shape}")
    check_settings(temperature, top_k, top_p, row.size)
    check_finite(row)
    if not 0 <= u < 1:
        raise SamplingError(f"u must lie in [0, 1), got {u!r}")
    # all ids sorted (one compilation per vocabulary size); the first top_k count
    out = _sample_one(
        row, jnp.float32(temperature), jnp.int32(top_k or 0), jnp.float32(top_p), jnp.float32(u), width=row.size
    )
    return int(out)


def check_finite(logits: np.ndarray) -> None:
    """SamplingError naming the first non-finite logit (a NaN or an infinity has no place in the sampler)."""
    bad = ~np.isfinite(logits)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise SamplingError(f"logits must be finite; found {logits[where]} at index {where}")


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How a generation chooses its tokens and where its text ends, checked when made: temperature 0 is greedy
    (argmax, the lowest id on ties), else the spec's sampler with top_k (None or 0: the whole vocabulary) and top_p
    (1.0: every candidate); seed: sequence b of a batch draws with seed + b, or with seed[b] for one seed per
    sequence (new token i uses uniform(seed, i)); stop: a text, or several (None: none), that ends the text
    before it (the token that completes one is the last generated); grammar: what the text must match
    (`text.grammar.Grammar`: a JSON schema, GBNF, ...; None: anything), each token drawn from the ones it allows."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    seed: int | tuple[int, ...] = 0
    stop: str | tuple[str, ...] | None = ()
    grammar: Grammar | None = None

    def __post_init__(self) -> None:
        check_settings(self.temperature, self.top_k, self.top_p, vocab=1)
        if not isinstance(self.seed, int | np.integer):
            if not isinstance(self.seed, Sequence | np.ndarray):
                raise SamplingError(f"seed {self.seed!r} is not an integer in [0, 2^32) or a list of them")
            object.__setattr__(self, "seed", tuple(self.seed))
        stops = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stops, Sequence) or not all(isinstance(s, str) and s for s in stops):
            raise InvalidArgumentError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(stops))
        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise InvalidArgumentError(
                f"grammar takes a llama_jax.Grammar (Grammar.json_schema(...), Grammar.gbnf(...), ...), got"
                f" {self.grammar!r:.80}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def seeds(self, batch: int) -> np.ndarray:
        """One seed per sequence [B] (uint32): the given ones, or seed + b for sequence b (`consecutive_seeds`);
        each in [0, 2^32)."""
        if isinstance(self.seed, int | np.integer):
            return np.asarray(consecutive_seeds(self.seed, batch), dtype=np.uint32)
        seeds = self.seed
        if len(seeds) != batch:
            raise SamplingError(f"{len(seeds)} seeds for {batch} sequences; give one seed per sequence, or one in all")
        return np.asarray([checked_seed(s) for s in seeds], dtype=np.uint32)


def checked_seed(seed: int) -> int:
    """A seed as an int, SamplingError unless it is an integer in [0, 2^32) (the spec's U32)."""
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= seed < SEEDS:
        raise SamplingError(f"seed {seed!r} is not an integer in [0, 2^32)")
    return int(seed)


def consecutive_seeds(seed: int, count: int, each: str = "sequence") -> tuple[int, ...]:
    """The seeds of `count` samples from one seed, the one rule wherever a seed is given for several (a batch's
    sequences, a server request's n choices; `each` names them in the message): seed + j for the j-th. Each is a
    seed, in [0, 2^32): SamplingError where the last is not, never a wrap to 0, which would silently repeat seed 0's
    draws."""
    seed = checked_seed(seed)
    last = seed + count - 1
    if last >= SEEDS:
        raise SamplingError(
            f"the {count} {each}s sample with seed + j ({each} j), and seed {seed} + {count - 1} = {last} is past"
            f" 2^32 - 1 (a seed is never wrapped): give a seed of at most {SEEDS - count}"
        )
    return tuple(range(seed, last + 1))
