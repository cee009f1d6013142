"""RMSNorm, in LlamaRMSNorm's order: g * (x * rsqrt(mean(x²) + eps))."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from llama_jax.nn.invariant import sum_last


def rms_norm(x: Float[Array, "*B D"], g: Float[Array, " D"], eps: float) -> Float[Array, "*B D"]:
    """Normalises the last axis of x (in f32, or f64 when x is f64) and scales it by the gains g; eps is static."""
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    variance = sum_last(x * x) / jnp.asarray(x.shape[-1], x.dtype)  # [*B, 1]: the mean, each row alone
    return g.astype(x.dtype) * (x * lax.rsqrt(variance + jnp.asarray(eps, x.dtype)))  # [*B, D]
