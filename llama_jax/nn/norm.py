"""RMSNorm, in LlamaRMSNorm's order: g * (x * rsqrt(mean(x²) + eps))."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from llama_jax.nn.invariant import sum_last


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def rms_norm(x: Float[Array, "*B D"], g: Float[Array, " D"], eps: float) -> Float[Array, "*B D"]:
    """Normalises the last axis of x (in f32, or f64 when x is f64) and scales it by the gains g; eps is static.
    Its derivative is written out (`_rms_norm_jvp`)."""
    x, g, r = _factor(x, g, eps)
    return g * (x * r)  # [*B, D]


def _factor(x, g, eps):
    """x and g in the computing type, and r = rsqrt(mean(x²) + eps) ([*B, 1]: each row alone)."""
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    variance = sum_last(x * x) / jnp.asarray(x.shape[-1], x.dtype)  # [*B, 1]: the mean, each row alone
    return x, g.astype(x.dtype), lax.rsqrt(variance + jnp.asarray(eps, x.dtype))


@rms_norm.defjvp
def _rms_norm_jvp(eps, primals, tangents):
    """d(g · x · r) = g · dx · r + x · (dr ⊗ g + r ⊗ dg), dr = -r³ · mean(x · dx): written so that a gradient keeps
    x, g and the [*B, 1] factors, where autodiff kept x · r as well ([*B, D]: a layer's stacked residuals 7 → 5).
    The outer products (⊗: a product over a size-1 axis) transpose into matrix products, the gradient's row sums
    (Σ_D ct · x · g, for dr) and its sum over the rows (Σ_B ct · x · r, for dg): XLA CPU's fused reductions took
    0.4-1 ms for each at 256 x 576, ~6% of a 256-token weight gradient of SmolLM2-135M (jax 0.10, Zen 4)."""
    x, g = primals
    dx, dg = tangents
    x, g, r = _factor(x, g, eps)
    dx, dg = dx.astype(x.dtype), dg.astype(x.dtype)
    dr = (r * r * r) * (sum_last(x * dx) / -jnp.asarray(x.shape[-1], x.dtype))  # [*B, 1]
    outer = functools.partial(jnp.einsum, "...i,ih->...h", preferred_element_type=x.dtype)  # [*B, 1], [1, D]
    return g * (x * r), g * (dx * r) + x * (outer(dr, g[None]) + outer(r, dg[None]))  # [*B, D] each
