"""Default RoPE (LlamaRotaryEmbedding): number i of a head's first half rotates with number i of its second half.

inv_freq[i] = 1 / theta^(2i / head), the angle of position p is p·inv_freq[i], and a head x = (lo, hi) becomes
(lo·cos - hi·sin, hi·cos + lo·sin), which is transformers' x·cos + rotate_half(x)·sin written per half.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from llama_jax.core.config import LlamaConfig


def inv_freq(config: LlamaConfig) -> np.ndarray:
    """The half frequencies 1 / theta^(2i/head), i = 0..half-1, in f32 as transformers computes them."""
    exponents = np.arange(0, config.head, 2, dtype=np.int64).astype(np.float32) / np.float32(config.head)
    return (np.float32(1.0) / (np.float32(config.theta) ** exponents)).astype(np.float32)  # [half]


def rope_tables(
    positions: Int[Array, "*B T"], config: LlamaConfig, dtype: jnp.dtype = jnp.float32
) -> tuple[Float[Array, "*B T P"], Float[Array, "*B T P"]]:
    """cos and sin of every position's angles, shared by every head of every layer (the spec's Rot); dtype: the
    activations' (f32; f64 in gradient checks)."""
    angles = positions.astype(dtype)[..., None] * jnp.asarray(inv_freq(config), dtype)  # [*B, T, half]
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(
    x: Float[Array, "B T E H"], cos: Float[Array, "B T P"], sin: Float[Array, "B T P"]
) -> Float[Array, "B T E H"]:
    """Rotates every head of x (n heads of H = 2·half numbers) by the angles of its position."""
    half = x.shape[-1] // 2
    lo, hi = x[..., :half], x[..., half:]  # [B, T, n, half] each
    c, s = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, half]
    return jnp.concatenate([lo * c + (-hi) * s, hi * c + lo * s], axis=-1)  # [B, T, n, H]
