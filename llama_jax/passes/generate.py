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
from llama_jax.passes.cached import attention_window, extend_unchecked, prefill
from llama_jax.passes.checks import check_context, check_count, check_tokens
from llama_jax.passes.sampling import Sampling, argmax_batch, sample_batch, width_for
from llama_jax.runtime.executables import persistent_jit

MIN_CAPACITY = 256
CHUNK = 8  # new tokens per device loop: streaming sees them CHUNK at a time
# how decode_chunk is jitted (the tests count its traces under the same options)
DECODE_JIT = {
    "static_argnames": ("config", "steps", "width", "greedy", "native", "window", "logprobs"),
    "donate_argnames": ("cache",),
}


def plan_capacity(prompt_len: int, max_new_tokens: int, config: LlamaConfig) -> int:
    """The cache capacity for a prompt and its new tokens; CapacityError up front if they exceed the context."""
    if prompt_len < 1:
        raise InvalidArgumentError("the prompt is empty; generation needs at least one token to start from")
    check_count(max_new_tokens, "max_new_tokens", least=0)
    needed = prompt_len + max_new_tokens
    what = f"a prompt of {prompt_len} tokens plus {max_new_tokens} new tokens needs {needed} positions, past"
    check_context(needed, config.context, what, "shorten the prompt or lower max_new_tokens")
    whole_chunks = prompt_len + -(-max_new_tokens // CHUNK) * CHUNK  # the last chunk may run past the last token
    return bucket(max(whole_chunks, MIN_CAPACITY), config.context)


def token_steps(
    weights: Weights,
    config: LlamaConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    mesh: Mesh | None = None,
    native: bool = False,
) -> Iterator[np.ndarray]:
    """The new ids of every sequence [B], one step at a time, max_new_tokens steps unless the caller stops
    early (sampling.stop is the caller's: it sees the text). Everything is checked before the first step: ids,
    capacity, settings, seeds. mesh: the cache is split over it like the (sharded) weights. native: decode with
    the native kernels (a Model's `native.active`, never for sharded weights)."""
    prompts = [np.asarray(p, dtype=np.int64) for p in prompts]
    if not prompts:
        raise InvalidArgumentError("no prompts to generate from; give at least one prompt")
    for p in prompts:
        check_tokens(p, config.vocab)
    lengths = [p.size for p in prompts]
    capacity = plan_capacity(max(lengths), max_new_tokens, config)
    if min(lengths) < 1:
        raise InvalidArgumentError("a prompt is empty; generation needs at least one token to start from")
    sampling = Sampling() if sampling is None else sampling  # greedy
    seeds = sampling.seeds(len(prompts))
    if max_new_tokens == 0:
        return
    block = padded_block(prompts, bucket(max(lengths), capacity))  # [B, T]
    batch = len(prompts)
    cache = KVCache.empty(config, batch, capacity)
    cache = cache if mesh is None else shard_cache(cache, config, mesh)
    logits, cache = prefill(weights, cache, block, config, n=lengths, native=native)
    width = 1 if sampling.greedy else width_for([sampling.top_k], config.vocab)
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
        out, logits, cache, _ = decode_chunk(
            weights, cache, logits, *settings, jnp.full(batch, done, jnp.int32),
            config=config, steps=steps, width=width, greedy=sampling.greedy, native=native, window=window,
        )  # fmt: skip
        yield from to_host(out).T[: max_new_tokens - done]  # gathered from every process on a mesh across them
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
    first: Int[Array, " B"],
    config: LlamaConfig,
    steps: int,
    width: int,
    greedy: bool,
    native: bool = False,
    window: int | None = None,
    logprobs: int | None = None,
) -> tuple[Int[Array, "B T"], Float[Array, "B V"], KVCache, TokenLogprobs | None]:
    """steps new tokens per sequence on the device: sequence b's token first[b]+i drawn from the logits (argmax
    when greedy, else the spec's sampler with uniform(seeds[b], first[b]+i)) and fed back through the layers.
    Returns the tokens, the logits after the last one, the cache, and with logprobs (static: how many of the most
    likely tokens to give beside each drawn one, 0 for none) each drawn token's log-probability under the model
    (its logits, before temperature) with the top ones (`TokenLogprobs`); else None. The caller has checked that
    steps more slots fit, inside the attention window. native: the native matrix-vector kernel (see `kernels`)."""
    batch = logits.shape[0]
    top = max(logprobs or 0, 1)

    def step(i, carry):
        cache, logits, out, lp = carry
        n = first + i  # [B]
        ids = argmax_batch(logits) if greedy else sample_batch(logits, temperature, top_k, top_p, seeds, n, width)
        if logprobs is not None:
            rows = log_softmax_last(logits)  # [B, V]: each row alone
            top_lp, top_ids = lax.top_k(rows, top)  # [B, top] each
            chosen = jnp.take_along_axis(rows, ids[:, None], axis=1)[:, 0]  # [B]
            lp = TokenLogprobs(
                lp.chosen.at[:, i].set(chosen), lp.ids.at[:, i].set(top_ids), lp.top.at[:, i].set(top_lp)
            )
        ones = jnp.ones(batch, jnp.int32)
        logits, cache = extend_unchecked(weights, cache, ids[:, None], ones, config, native, window)
        return cache, logits, out.at[:, i].set(ids), lp

    lp = None
    if logprobs is not None:
        lp = TokenLogprobs(
            jnp.zeros((batch, steps)), jnp.zeros((batch, steps, top), jnp.int32), jnp.zeros((batch, steps, top))
        )
    carry = (cache, logits, jnp.zeros((batch, steps), jnp.int32), lp)
    cache, logits, out, lp = lax.fori_loop(0, steps, step, carry)
    return out, logits, cache, lp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """Of each drawn token [B, T]: its log-probability (chosen), and the most likely tokens there with theirs (ids,
    top: [B, T, k], the most likely first, ties by lower id)."""

    chosen: Float[Array, "B T"]
    ids: Int[Array, "B T K"]
    top: Float[Array, "B T K"]
