"""Products and sums whose every row comes out the same whatever the other rows: a sequence's numbers are then
the same bits alone and in any batch, at any place in it, with any padding after it.

XLA CPU picks the order of a reduction (vectorisation, unrolling, a tree) from the whole shape, so a row summed
inside a [144, S] array and inside a [9, S] one, or with more masked slots after it, can differ in the last bit.
Its matrix-matrix products don't: a row of the result depends on neither the other rows nor zeros that trail the
inner dimension, as long as the number of columns is fixed (measured on jax 0.10 over the shapes of these models,
and asserted by tests/test_batch_invariance.py). Its matrix-vector path (one row) sums in another order, so a lone
row is multiplied as a pair with a zero row (behind an optimization barrier, which keeps XLA from slicing the
pair's product back to one row). The sums whose shape depends on the batch (softmax denominators, RMSNorm's mean
of squares, log-softmax in scoring) are products with a fixed number of columns of ones.

What stays outside: XLA evaluates exp with a code path chosen by the array's size, so its decode step at batch 1
can differ from batch ≥ 2 in the last bits (the native decode step, prefill and scoring do not).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

_ONES = 8  # columns of ones: a product with a single column would take the matrix-vector path


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
    """The sum over the last axis (kept, of size 1), each row on its own."""
    return matmul_t(x, jnp.ones((_ONES, x.shape[-1]), x.dtype))[..., :1]  # [*A, 1]


def softmax_last(x: Float[Array, "*A S"]) -> Float[Array, "*A S"]:
    """jax.nn.softmax over the last axis, in its order (exp(x - max) / Σ exp(x - max)), the sum by `sum_last`."""
    e = jnp.exp(x - lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))  # [*A, S]
    return e / sum_last(e)  # [*A, S]


def log_softmax_last(x: Float[Array, "*A S"]) -> Float[Array, "*A S"]:
    """jax.nn.log_softmax over the last axis, in its order (x - max - log Σ exp(x - max)), the sum by `sum_last`."""
    shifted = x - lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))  # [*A, S]
    return shifted - jnp.log(sum_last(jnp.exp(shifted)))  # [*A, S]
