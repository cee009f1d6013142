"""The passes that write a KV cache: `prefill` (a block of tokens per sequence), `decode_step` (one token per
sequence), and their pure body `extend`.

`prefill` and `decode_step` are jitted with the cache donated (updated in place), their executables kept on disk
(`runtime.executables`), and check on the host first (`checks`): a write at or past the capacity raises
CapacityError and a token id outside [0, vocab) raises TokenIdError. `extend` carries the same checks inside the
graph (checkify), for composing it into other jitted code; `checks.throw` raises a failed one as the package's
error. Attention reads only the part of the cache written so far, a bucket of it (`KVCache.attention_window`).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from llama_jax.core.config import LlamaConfig
from llama_jax.core.kv_cache import KVCache
from llama_jax.core.weights import Weights
from llama_jax.errors import InvalidArgumentError
from llama_jax.nn.head import embed, unembed
from llama_jax.passes.checks import (
    check_room,
    check_room_traced,
    check_tokens,
    check_tokens_traced,
    check_window_traced,
)
from llama_jax.passes.forward import run_layers
from llama_jax.runtime.executables import persistent_jit

# how prefill's and decode_step's bodies are jitted (the tests count their traces under the same options)
EXTEND_JIT = {"static_argnames": ("config", "native", "window"), "donate_argnames": ("cache",)}


def extend(
    weights: Weights,
    cache: KVCache,
    tokens: Int[ArrayLike, "B T"],
    n: Int[Array, " B"],
    config: LlamaConfig,
    window: int | None = None,
) -> tuple[Float[Array, "B V"], KVCache]:
    """T tokens of sequence b written at slots length[b]..length[b]+T-1, its first n[b] real and the rest padding
    (whose slots its later writes overwrite); the logits after each sequence's last real token; each length grown
    by its n[b]. Sequence b's positions are its slots: padding never shifts them.

    Pure, with checkify checks on the capacity, the attention window and the token ids: call it under
    `checkify.checkify` (as `prefill` and `decode_step` do) to compose it into other jitted code. window
    (static): attend to cache slots 0..window-1 only (default: all)."""
    check_room_traced(cache, tokens.shape[1])
    if window is not None:
        check_window_traced(cache, tokens.shape[1], window)
    check_tokens_traced(tokens, config.vocab)
    return extend_unchecked(weights, cache, tokens, n, config, window=window)


def extend_unchecked(
    weights: Weights,
    cache: KVCache,
    tokens: Int[ArrayLike, "B T"],
    n: Int[Array, " B"],
    config: LlamaConfig,
    native: bool = False,
    window: int | None = None,
) -> tuple[Float[Array, "B V"], KVCache]:
    """`extend` without its checks, for loops whose caller has checked the room and draws the ids itself.
    native (static): the native kernels (see `kernels`): the matrix-vector one for the LM head (one position per
    sequence) and the layers of a one-token step, the block product for a longer block's layers. window (static): the
    cache slots attended to; the caller guarantees window ≥ max(length) + T (see `KVCache.attention_window`)."""
    _, logits, cache = extend_stream(weights, cache, tokens, n, config, native, window)
    return logits, cache


def extend_stream(
    weights: Weights,
    cache: KVCache,
    tokens: Int[ArrayLike, "B T"],
    n: Int[Array, " B"],
    config: LlamaConfig,
    native: bool = False,
    window: int | None = None,
) -> tuple[Float[Array, "B T D"], Float[Array, "B V"], KVCache]:
    """`extend_unchecked`, also returning the last layer's output at every position written (for a pass that
    reads more from it than the last logits: a prompt's log-probabilities, `decode_batch.prefill_row`)."""
    weights.assert_matches(config)  # chex, at trace time: shapes the config derives (`arrays`)
    cache.assert_matches(config)
    t = tokens.shape[1]
    positions = cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
    x, cache_after, _ = run_layers(
        weights, embed(weights, tokens, config), positions, config, cache, (), None, native, window, real=n
    )
    last = jnp.take_along_axis(x, (n - 1)[:, None, None], axis=1)  # [B, 1, D]
    _, logits = unembed(weights, last, config, native, step=True)  # [B, 1, V]
    return x, logits[:, 0], cache_after.with_length(cache.length + n)


@persistent_jit(**EXTEND_JIT)
def _extend_jit(weights, cache, tokens, n, config, native, window):
    return extend_unchecked(weights, cache, tokens, n, config, native, window)


def prefill(
    weights: Weights,
    cache: KVCache,
    tokens: Int[ArrayLike, "B T"],
    config: LlamaConfig,
    n: int | Sequence[int] | None = None,
    native: bool = False,
) -> tuple[Float[Array, "B V"], KVCache]:
    """Writes a block of T tokens per sequence into the cache (one pass per layer, causal mask) and returns the
    logits after each sequence's last real token and the cache. n: the real tokens of each sequence (one number
    for all, or one per sequence; default T), the rest of its row padding, so that prompts of different lengths
    share a batch and a new length does not recompile. Attention reads only the part of the cache written so far
    (a bucket of it). native: the native kernels (a Model's `native.active`; see `kernels`). Compiled once
    per (B, T, capacity, window bucket); the cache is donated."""
    tokens = np.asarray(tokens)
    b, t = tokens.shape
    counts = np.full(b, t, dtype=np.int32) if n is None else np.broadcast_to(np.asarray(n, dtype=np.int32), (b,))
    if np.any(counts < 1) or np.any(counts > t):
        raise InvalidArgumentError(f"each row of a prefill of {t} slots holds 1 to {t} real tokens, got n = {n}")
    check_tokens(tokens, config.vocab)
    written = check_room(cache, t)
    window = cache.attention_window(written, t, minimum=t)
    tokens, counts = jnp.asarray(tokens, jnp.int32), jnp.asarray(counts)
    return _extend_jit(weights, cache, tokens, counts, config=config, native=native, window=window)


def decode_step(
    weights: Weights,
    cache: KVCache,
    tokens: Int[ArrayLike, " B"],
    config: LlamaConfig,
    native: bool = False,
) -> tuple[Float[Array, "B V"], KVCache]:
    """One new token per sequence at slot cache.length: its logits and the cache grown by one. native: as for
    `prefill`. Compiled once per (B, capacity, window bucket); the cache is
    donated (updated in place; do not reuse the one passed in)."""
    tokens = np.asarray(tokens)
    check_tokens(tokens, config.vocab)
    window = cache.attention_window(check_room(cache, 1), 1)
    return _decode_jit(weights, cache, jnp.asarray(tokens, jnp.int32), config=config, native=native, window=window)


@persistent_jit(**EXTEND_JIT)
def _decode_jit(weights, cache, tokens, config, native, window):
    return extend_unchecked(weights, cache, tokens[:, None], jnp.ones(tokens.shape, jnp.int32), config, native, window)
