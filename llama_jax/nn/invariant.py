"""Products and sums whose every row comes out the same whatever the other rows: a sequence's numbers are then
the same bits alone and in any batch, at any place in it, with any padding after it.

XLA CPU picks the order of a reduction (vectorisation, unrolling, a tree) from the whole shape, so a row summed
inside a [144, S] array and inside a [9, S] one, or with more masked slots after it, can differ in the last bit.
Its matrix-matrix products don't: a row of the result depends on neither the other rows nor zeros that trail the
inner dimension, as long as the number of columns is fixed (measured on jax 0.10 over the shapes of these models,
and asserted by tests/test_batch_invariance.py). Its matrix-vector path (one row) sums in another order, so a lone
row is multiplied as a pair with a zero row (behind an optimization barrier, which keeps XLA from slicing the
pair's product back to one row).

XLA's transcendental functions and small products are not: on an AVX2 CPU (AMD Zen 2) jnp.exp gives an element
other bits when the array around it has another size (a loop's vector body and its tail compute it differently),
and a product with a few columns of ones sums a row in an order that depends on the number of rows. So the sums
whose length varies (a softmax's) are a fixed tree of elementwise additions, and exp and log are written out in
elementwise operations (Cephes' expf and logf: range reduction and a polynomial, within 1.3 ulp), which every lane
of every loop computes alike; their derivatives are exact (exp(x), 1/x). In float64 (gradient checks) XLA's own
exp and log serve.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int


def matmul_t(x: Float[Array, "*A I"], w: Float[Array, "O I"]) -> Float[Array, "*A O"]:
    """x · wᵀ in x's dtype (w widened to it exactly), each row of x on its own."""
    lead, n_in = x.shape[:-1], x.shape[-1]
    w = w.astype(x.dtype)
    if math.prod(lead) != 1:
        return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=x.dtype)  # [*A, O]
    pair = jnp.concatenate([x.reshape(1, n_in), jnp.zeros((1, n_in), x.dtype)])  # [2, I]: the row and a zero row
    pair = lax.optimization_barrier(pair)  # else XLA slices the product back down to one row
    return jnp.einsum("ri,oi->ro", pair, w, preferred_element_type=x.dtype)[:1].reshape(*lead, w.shape[0])


def sum_last(x: Float[Array, "*A S"]) -> Float[Array, "*A 1"]:
    """The sum over the last axis (kept, of size 1), each row on its own: a pairwise tree (the first half plus the
    second, an odd last number carried), the same additions in the same order whatever the other rows."""
    while x.shape[-1] > 1:
        n = x.shape[-1]
        pairs = x[..., : n // 2] + x[..., n // 2 : n // 2 * 2]  # [*A, n // 2]
        x = jnp.concatenate([pairs, x[..., n // 2 * 2 :]], axis=-1) if n % 2 else pairs
    return x  # [*A, 1]


def _power_of_two(n: Int[Array, "*A"]) -> Float[Array, "*A"]:
    """2^n in f32 for n in [-126, 127], built from its bits."""
    return lax.bitcast_convert_type((n + 127) << 23, jnp.float32)


@jax.custom_jvp
def exp(x: Float[Array, "*A"]) -> Float[Array, "*A"]:
    """e^x, the same bits for an element wherever it stands (Cephes' expf: x = n ln 2 + r, |r| ≤ ln 2 / 2, e^r by
    a degree-6 polynomial, times 2^n in two steps; 0 below ln 2^-150, inf above the largest f32's log)."""
    if x.dtype != jnp.float32:
        return jnp.exp(x)
    f32 = jnp.float32
    n = jnp.round(x * f32(1.44269504088896341))
    r = (x - n * f32(0.693359375)) + n * f32(2.12194440e-4)  # ln 2 in two parts: n · the first is exact
    p = f32(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f32(c)
    p = (p * r) * r + (r + f32(1.0))  # e^r
    n = jnp.clip(n, -150, 128).astype(jnp.int32)
    y = (p * _power_of_two(n >> 1)) * _power_of_two(n - (n >> 1))
    y = jnp.where(x < f32(-103.972084), f32(0.0), y)
    return jnp.where(x > f32(88.7228391), f32(jnp.inf), y)


@exp.defjvp
def _exp_jvp(primals, tangents):
    y = exp(primals[0])
    return y, y * tangents[0]


@jax.custom_jvp
def log(x: Float[Array, "*A"]) -> Float[Array, "*A"]:
    """ln x for x > 0 (a softmax's sum: ≥ 1), the same bits for an element wherever it stands (Cephes' logf: x =
    m · 2^e, m in [√½, √2), ln m by a polynomial in m - 1, plus e ln 2 in two parts). Normal numbers only."""
    if x.dtype != jnp.float32:
        return jnp.log(x)
    f32 = jnp.float32
    bits = lax.bitcast_convert_type(x, jnp.int32)
    e = (bits >> 23) - 126  # x = m · 2^e with m in [0.5, 1)
    m = lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F000000, jnp.float32)
    low = m < f32(0.707106781186547524)
    e = jnp.where(low, e - 1, e).astype(jnp.float32)
    m = jnp.where(low, m + m, m) - f32(1.0)  # in [√½ - 1, √2 - 1)
    z = m * m
    p = f32(7.0376836292e-2)
    for c in (-1.1514610310e-1, 1.1676998740e-1, -1.2420140846e-1, 1.4249322787e-1, -1.6668057665e-1,
              2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1):  # fmt: skip
        p = p * m + f32(c)
    y = ((p * m) * z + e * f32(-2.12194440e-4)) + f32(-0.5) * z
    return (m + y) + e * f32(0.693359375)


@log.defjvp
def _log_jvp(primals, tangents):
    return log(primals[0]), tangents[0] / primals[0]


def softmax_last(x: Float[Array, "*A S"]) -> Float[Array, "*A S"]:
    """jax.nn.softmax over the last axis, in its order (exp(x - max) / Σ exp(x - max)), by `exp` and `sum_last`."""
    e = exp(x - lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))  # [*A, S]
    return e / sum_last(e)  # [*A, S]


def log_softmax_last(x: Float[Array, "*A S"]) -> Float[Array, "*A S"]:
    """jax.nn.log_softmax over the last axis, in its order (x - max - log Σ exp(x - max)), by `exp`, `log` and
    `sum_last`."""
    shifted = x - lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))  # [*A, S]
    return shifted - log(sum_last(exp(shifted)))  # [*A, S]
