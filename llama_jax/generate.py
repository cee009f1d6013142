"""Generation: prefill the prompts (a batch, each padded to the length bucket), then the new tokens in chunks of
CHUNK, each chunk one jitted loop on the device that draws a token and feeds it back, CHUNK times, with no trip
to the host between tokens.

Prompts of different lengths share the batch: each sits at its own positions from 0 (right padding, masked), so
a sequence gets in a batch the tokens it gets alone. The cache's capacity is the bucket of the longest prompt +
new tokens, at least MIN_CAPACITY and at most the model's context, so the decode step compiles once per
(batch, capacity bucket), not per prompt. Draws follow the spec's sampler (`sampling`): new token i of sequence b
uses uniform(seeds[b], i).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int, UInt32

from llama_jax.buckets import bucket
from llama_jax.cache import KVCache
from llama_jax.config import LlamaConfig
from llama_jax.errors import CapacityError, InvalidArgumentError, SamplingError
from llama_jax.executables import persistent_jit
from llama_jax.passes import attention_window, check_tokens, extend_unchecked, prefill, uses_native
from llama_jax.sampling import argmax_batch, check_settings, sample_batch, width_for
from llama_jax.sharding import shard_cache
from llama_jax.weights import Weights

MIN_CAPACITY = 256
CHUNK = 8  # new tokens per device loop: streaming sees them CHUNK at a time
# how decode_chunk is jitted (the tests count its traces under the same options)
DECODE_JIT = {
    "static_argnames": ("config", "steps", "width", "greedy", "native", "window"),
    "donate_argnames": ("cache",),
}
_SEEDS = 2**32  # seeds are the spec's U32


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each new token is chosen: temperature 0 is greedy (argmax, the lowest id on ties); top_k None or 0
    keeps the whole vocabulary; top_p 1.0 keeps every candidate."""

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self) -> None:
        check_settings(self.temperature, self.top_k, self.top_p, vocab=1)


def seeds_for(seed: int | Sequence[int], batch: int) -> np.ndarray:
    """One seed per sequence: the given list, or seed + b for sequence b; each in [0, 2^32)."""
    seeds = [seed + b for b in range(batch)] if isinstance(seed, int | np.integer) else list(seed)
    if len(seeds) != batch:
        raise SamplingError(f"{len(seeds)} seeds for {batch} sequences; give one seed per sequence, or one in all")
    bad = [s for s in seeds if isinstance(s, bool) or not isinstance(s, int | np.integer) or not 0 <= s < _SEEDS]
    if bad:
        raise SamplingError(f"seed {bad[0]!r} is not an integer in [0, 2^32) (sequence b of a batch uses seed + b)")
    return np.asarray(seeds, dtype=np.uint32)


def plan_capacity(prompt_len: int, max_new_tokens: int, config: LlamaConfig) -> int:
    """The cache capacity for a prompt and its new tokens; CapacityError up front if they exceed the context."""
    if prompt_len < 1:
        raise InvalidArgumentError("the prompt is empty; generation needs at least one token to start from")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise InvalidArgumentError(f"max_new_tokens must be an integer ≥ 0, got {max_new_tokens!r}")
    needed = prompt_len + max_new_tokens
    if needed > config.context:
        raise CapacityError(
            f"a prompt of {prompt_len} tokens plus {max_new_tokens} new tokens needs {needed} positions, past the"
            f" model's context of {config.context}; shorten the prompt or lower max_new_tokens"
        )
    whole_chunks = prompt_len + -(-max_new_tokens // CHUNK) * CHUNK  # the last chunk may run past the last token
    return bucket(max(whole_chunks, MIN_CAPACITY), config.context)


def token_steps(
    weights: Weights,
    config: LlamaConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    seeds: np.ndarray | None = None,
    mesh: Mesh | None = None,
    native: bool | None = None,
) -> Iterator[np.ndarray]:
    """The new ids of every sequence [B], one step at a time, max_new_tokens steps unless the caller stops
    early. Everything is checked before the first step: ids, capacity, settings, seeds. mesh: the cache is split
    over it like the (sharded) weights. native: decode with the native kernels (default: where $LLAMA_JAX_NATIVE
    lets them run, see `kernels`); never for sharded weights, which the kernels would read whole."""
    prompts = [np.asarray(p, dtype=np.int64) for p in prompts]
    if not prompts:
        raise InvalidArgumentError("no prompts to generate from; give at least one prompt")
    for p in prompts:
        check_tokens(p, config.vocab)
    lengths = [p.size for p in prompts]
    capacity = plan_capacity(max(lengths), max_new_tokens, config)
    if min(lengths) < 1:
        raise InvalidArgumentError("a prompt is empty; generation needs at least one token to start from")
    seeds = seeds_for(0, len(prompts)) if seeds is None else seeds
    if max_new_tokens == 0:
        return
    block = np.zeros((len(prompts), bucket(max(lengths), capacity)), dtype=np.int32)  # [B, T]
    for b, p in enumerate(prompts):
        block[b, : p.size] = p
    batch = len(prompts)
    cache = KVCache.empty(config, batch, capacity)
    cache = cache if mesh is None else shard_cache(cache, config, mesh)
    native = mesh is None and uses_native(weights, native)
    logits, cache = prefill(weights, cache, block, config, n=lengths, native=native)
    greedy = sampling.temperature == 0
    width = 1 if greedy else width_for([sampling.top_k], config.vocab)
    settings = (
        jnp.full(batch, sampling.temperature, jnp.float32),
        jnp.full(batch, sampling.top_k or 0, jnp.int32),
        jnp.full(batch, sampling.top_p, jnp.float32),
        jnp.asarray(seeds),
    )
    done = 0
    while done < max_new_tokens:
        steps = min(CHUNK, capacity - max(lengths) - done)  # a whole chunk, unless the context ends first
        window = attention_window(max(lengths) + done, steps, capacity)
        out, logits, cache = decode_chunk(
            weights, cache, logits, *settings, jnp.int32(done),
            config=config, steps=steps, width=width, greedy=greedy, native=native, window=window,
        )  # fmt: skip
        yield from np.asarray(out).T[: max_new_tokens - done]
        done += steps


@persistent_jit(**DECODE_JIT)
def decode_chunk(
    weights: Weights,
    cache: KVCache,
    logits: Float[Array, "B V"],
    temperature: Float[Array, " B"],
    top_k: Int[Array, " B"],
    top_p: Float[Array, " B"],
    seeds: UInt32[Array, " B"],
    first: Int[Array, ""],
    config: LlamaConfig,
    steps: int,
    width: int,
    greedy: bool,
    native: bool = False,
    window: int | None = None,
) -> tuple[Int[Array, "B steps"], Float[Array, "B V"], KVCache]:
    """steps new tokens per sequence on the device: token first+i drawn from the logits (argmax when greedy,
    else the spec's sampler with uniform(seeds[b], first+i)) and fed back through the layers. Returns the tokens,
    the logits after the last one and the cache. The caller has checked that steps more slots fit, inside the
    attention window. native: the native matrix-vector kernel (see `kernels`) for the products."""
    batch = logits.shape[0]

    def step(i, carry):
        cache, logits, out = carry
        n = jnp.full(batch, first + i, jnp.int32)
        ids = argmax_batch(logits) if greedy else sample_batch(logits, temperature, top_k, top_p, seeds, n, width)
        ones = jnp.ones(batch, jnp.int32)
        logits, cache = extend_unchecked(weights, cache, ids[:, None], ones, config, native, window)
        return cache, logits, out.at[:, i].set(ids)

    cache, logits, out = lax.fori_loop(0, steps, step, (cache, logits, jnp.zeros((batch, steps), jnp.int32)))
    return out, logits, cache


def greedy(
    weights: Weights, config: LlamaConfig, ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int]
) -> list[int]:
    """The new ids after `ids`, each the argmax of its logits (the lowest id on ties), ending with the first
    end-of-sequence id if one comes before max_new_tokens."""
    new: list[int] = []
    for step in token_steps(weights, config, [ids], max_new_tokens):
        new.append(int(step[0]))
        if new[-1] in eos_ids:
            break
    return new
