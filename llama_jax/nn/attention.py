"""Grouped-query causal attention, in the queries' dtype (f32), without repeating the keys and values.

Query head j·g + i reads key/value head j (the spec's gqa_head law, transformers' repeat_kv mapping): the query
heads are viewed as [K, G] and each group of G heads meets its own key/value head in one einsum. The softmax
sums each row on its own (`invariant`): masked slots and the batch's other sequences change no bit of a row.

`layer_attention` is the one place that chooses how a layer's queries attend: a decode step's native kernel
reading the cache in place, the native block kernel, or XLA's products (which also give the pattern).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int

from llama_jax import kernels
from llama_jax.core.kv_cache import KVCache
from llama_jax.nn.invariant import softmax_last

# the rotated queries [B, T, N, H] and the pattern's edit (or None) -> each head's output [B, T, N, H] and the
# pattern [B, N, T, S] (None where the attention cannot give it: the native decode kernel)
Attend = Callable[[Array, Callable[[Array], Array] | None], tuple[Array, Array | None]]


def group_heads(x: Float[Array, "B T N H"], kv: int) -> Float[Array, "B T K G H"]:
    """Query heads 0..N-1 cut into kv groups of G = N/kv consecutive heads: head j·G + i is [j, i]."""
    b, t, n, h = x.shape
    return x.reshape(b, t, kv, n // kv, h)


KEY_BLOCK = 64  # keys per block of the scores' product: its width, whatever the window (see `attention_with_pattern`)
HEAD_BLOCK = 64  # the scores' inner size is padded to a multiple of it (see `attention_with_pattern`)


def attention_with_pattern(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B K S H"],
    v: Float[Array, "B K S H"],
    mask: Bool[Array, "B T S"],
    edit: Callable[[Array], Array] | None = None,
    scale: float | None = None,
) -> tuple[Float[Array, "B T N H"], Float[Array, "B N T S"]]:
    """softmax(q·kᵀ · scale where mask, else -inf) · v for every query head (its group's key/value head), and
    the pattern: the softmax probabilities [B, N, T, S] (0 where masked), after `edit`
    (research: an intervention at the pattern, which the product with the values then sees, masked slots included,
    as autograd's gradient with respect to the probabilities has them; None: none, and the output is the same
    bits as without a pattern asked for). scale: the config's `attention_scale` (None: 1/sqrt(H), rounded to f32).

    Batch invariance: XLA's product sums a column of q·kᵀ in an order that depends on how many columns (keys)
    the product has, so the keys are cut into blocks of KEY_BLOCK (zero keys, masked, fill the last) and the
    scores are one product per block, always KEY_BLOCK wide; the window and the batch then change no bit. And the
    product's sum over a head's H numbers takes an order that depends on how many query rows it has unless H is a
    multiple of 64 (or at most 16; measured with XLA CPU for H from 8 to 256: 24, 32, 40, 48, 80, 96, 100, 112 and
    160 differ by an ulp between 2 and 128 rows), and so does the product with the values unless its H output
    columns are: so q, k and v are padded with zeros to a multiple of HEAD_BLOCK (exact zeros added to each score;
    zero columns of the output, sliced off), and the block's length then changes no bit either."""
    b, t, n, h = q.shape
    kv, s = k.shape[1], k.shape[2]
    blocks = -(-s // KEY_BLOCK)
    pad = blocks * KEY_BLOCK - s
    if pad:  # zero keys and values behind a False mask: they add exact zeros
        k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))  # [B, K, S', H]
        v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
        mask = jnp.pad(mask, ((0, 0), (0, 0), (0, pad)))  # [B, T, S']
    g = n // kv
    qg = group_heads(q, kv).transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, h)  # [B, K, G·T, H]
    qb = jnp.broadcast_to(qg[:, :, None], (b, kv, blocks, g * t, h))  # [B, K, C, M, H]
    kb = k.astype(q.dtype).reshape(b, kv, blocks, KEY_BLOCK, h)  # [B, K, C, KEY_BLOCK, H]
    wide = -(-h // HEAD_BLOCK) * HEAD_BLOCK if h > 16 else h  # zero numbers that add exact zeros to each score
    if wide != h:
        qb, kb = (jnp.pad(a, ((0, 0),) * 4 + ((0, wide - h),)) for a in (qb, kb))  # [B, K, C, M | KEY_BLOCK, H']
    scores = lax.dot_general(qb, kb, (((4,), (4,)), ((0, 1, 2), (0, 1, 2))))  # [B, K, C, M, KEY_BLOCK]
    scores = scores.transpose(0, 1, 3, 2, 4).reshape(b, kv, g, t, blocks * KEY_BLOCK)  # [B, K, G, T, S']
    scores = scores * jnp.asarray(1.0 / math.sqrt(h) if scale is None else scale, jnp.float32).astype(q.dtype)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)  # [B, K, G, T, S']
    weights = softmax_last(scores)  # [B, K, G, T, S']
    pattern = weights.reshape(b, n, t, blocks * KEY_BLOCK)[..., :s]  # [B, N, T, S]: head j·G + i is [j, i]
    if edit is not None:  # applied as given, as a TransformerLens hook's: a value put at a masked slot is used
        pattern = edit(pattern)  # [B, N, T, S]
        weights = jnp.pad(pattern, ((0, 0), (0, 0), (0, 0), (0, pad))).reshape(weights.shape)  # [B, K, G, T, S']
    batch = ((0, 1), (0, 1))  # batched over (B, K): each group meets its own key/value head
    vw = v.astype(q.dtype)  # [B, K, S', H]
    if wide != h:  # zero columns, sliced off
        vw = jnp.pad(vw, ((0, 0),) * 3 + ((0, wide - h),))  # [B, K, S', H']
    out = lax.dot_general(weights, vw, (((4,), (2,)), batch))[..., :h]  # [B, K, G, T, H]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h), pattern  # [B, T, N, H], [B, N, T, S]


def causal_mask(positions: Int[Array, "B T"], slots: int, sliding_window: int | None = None) -> Bool[Array, "B T S"]:
    """Query t sees slot s where s <= its position (the causal law; a cache's slots are its sequence's positions)
    and, with a sliding window (Mistral's), position - s < window (transformers' `sliding_window_overlay`)."""
    s = jnp.arange(slots, dtype=jnp.int32)[None, None, :]  # [1, 1, S]
    mask = s <= positions[:, :, None]  # [B, T, S]
    if sliding_window is not None:
        mask = mask & (positions[:, :, None] - s < sliding_window)  # [B, T, S]
    return mask


def layer_attention(
    k: Float[Array, "B K S H"],
    v: Float[Array, "B K S H"],
    mask: Bool[Array, "B T S"],
    seen: Int[Array, "B T"],
    sliding_window: int | None,
    keep_pattern: bool,
    native: bool,
    step: tuple[KVCache, Int[Array, ""], Int[Array, " B"]] | None = None,
    scale: float | None = None,
) -> Attend:
    """How a layer's queries attend to the keys and values k, v at the slots `seen` says they sit at (mask =
    `causal_mask(seen, S, sliding_window)`), keeping the pattern where asked (static). step: a decode step's
    (cache, layer, positions): one query per sequence at `positions`, the layer's keys already written into the
    cache. With native (static) a step runs the native kernel over the cache in place (`KVCache.reach`: no
    pattern, no edit of it), a block `causal_attention`. scale: the scores' (the config's `attention_scale`)."""
    if native and step is not None:
        cache, layer, positions = step
        last, window = cache.reach(positions, sliding_window)  # [B]

        def attend_in_place(q: Float[Array, "B 1 N H"], _edit: None) -> tuple[Float[Array, "B 1 N H"], None]:
            return kernels.attend(cache.k, cache.v, layer, last, q[:, 0], window, scale)[:, None], None  # [B, 1, N, H]

        return attend_in_place

    def attend(q: Float[Array, "B T N H"], edit: Callable[[Array], Array] | None):
        return causal_attention(q, k, v, mask, seen, edit, keep_pattern, native, sliding_window, scale)

    return attend


def causal_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B K S H"],
    v: Float[Array, "B K S H"],
    mask: Bool[Array, "B T S"],
    positions: Int[Array, "B T"],
    edit: Callable[[Array], Array] | None,
    keep_pattern: bool,
    native: bool,
    sliding_window: int | None = None,
    scale: float | None = None,
) -> tuple[Float[Array, "B T N H"], Float[Array, "B N T S"] | None]:
    """A block of queries' attention under `causal_mask(positions, sliding_window)` (= mask) and its pattern where
    kept (static):
    the one place that chooses the attention. The native kernel (`native_causal_attention`) where the pass runs
    the native kernels on f32 activations and the pattern is not edited: its output is the same bits whether the
    pattern is kept (then XLA's probabilities, computed beside it) or not; else `attention_with_pattern`."""
    if native and q.dtype == jnp.float32 and edit is None:
        pattern = attention_with_pattern(q, k, v, mask, scale=scale)[1] if keep_pattern else None  # [B, N, T, S]
        return native_causal_attention(q, k, v, positions, sliding_window, scale), pattern  # [B, T, N, H]
    return attention_with_pattern(q, k, v, mask, edit, scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def native_causal_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B K S H"],
    v: Float[Array, "B K S H"],
    positions: Int[Array, "B T"],
    sliding_window: int | None = None,
    scale: float | None = None,
) -> Float[Array, "B T N H"]:
    """`attention_with_pattern`'s output under `causal_mask(positions, sliding_window)` and the scale, by the
    native kernel,
    which computes only the slots at or before each query (`kernels.attend_block`; f32, no pattern). Its gradient
    is the native kernel's too (`kernels.attend_block_grads`: the slots each query reads only, the probabilities
    recomputed; tested against XLA's autograd through `attention_with_pattern` and float64's)."""
    return kernels.attend_block(q, k, v, positions, sliding_window, scale)


def _native_fwd(q, k, v, positions, sliding_window, scale):
    out = kernels.attend_block(q, k, v, positions, sliding_window, scale)
    return out, (q, k, v, positions, out)


def _native_bwd(sliding_window, scale, saved, g):
    q, k, v, positions, out = saved
    return (*kernels.attend_block_grads(q, k, v, positions, out, g, sliding_window, scale), None)


native_causal_attention.defvjp(_native_fwd, _native_bwd)
