"""The one matrix product of the model: x · Wᵀ with W stored [out, in] (PyTorch's nn.Linear), in f32.

Accuracy: XLA CPU's matrix-matrix product accumulates the whole inner dimension in one running sum, about four
times the rounding error of PyTorch's (MKL's) for in = 1536, and a residual stream amplifies it: the activations
drifted from transformers' by several times the 1e-4 tolerance. So a block of positions sums the inner dimension
in blocks of ACC_BLOCK numbers, each block's product rounded once and the partial products added pairwise, which
brings the error to PyTorch's level (measured against float64; blocks of 384 or 768 did not). One position at
a time (decode) takes XLA's
matrix-vector path, whose error is already that small. The product runs in the activations' dtype (f32; f64 in
gradient checks): a bf16 weight is widened to it exactly before the product.

`product` is where a pass's "native or XLA?" becomes a choice of product, for every matrix (the layers' and the
LM head): the one place that decides it.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from llama_jax import kernels
from llama_jax.core.quantized import HeldLayer, Matrix, SlicedLayer, dense
from llama_jax.nn.invariant import matmul_t

ACC_BLOCK = 192


def linear(x: Float[Array, "*B T I"], w: Float[Array, "O I"], blocked: bool = True) -> Float[Array, "*B T O"]:
    """x · wᵀ; blocked (static): sum the inner dimension in ACC_BLOCK blocks (the layers; the LM head, whose
    result feeds no later layer and whose [T, vocab] partial products would cost more than they save, does not)."""
    n_in = x.shape[-1]
    if x.shape[-2] == 1 or n_in <= ACC_BLOCK or not blocked:
        return matmul_t(x, w)  # [*B, T, O]: each row alone (see `invariant`)
    parts = [matmul_t(x[..., s : s + ACC_BLOCK], w[:, s : s + ACC_BLOCK]) for s in range(0, n_in, ACC_BLOCK)]
    while len(parts) > 1:  # pairwise: [p0 + p1, p2 + p3, ...] until one is left
        pairs = [parts[j] + parts[j + 1] for j in range(0, len(parts) - 1, 2)]
        parts = pairs + parts[2 * len(pairs) :]
    return parts[0]  # [*B, T, O]


def runs_native(w: Matrix, dtype: jnp.dtype | type, native: bool) -> bool:
    """Whether x · wᵀ runs as the native block product: a pass running the native kernels (`native`, a Model's
    decision), on a matrix held in a kind the kernel multiplies, with activations of this dtype
    (`kernels.multiplies`: f64 activations, as in gradient checks, take XLA's products)."""
    return native and kernels.multiplies(w, dtype)


def product(
    x: Float[Array, "*B T I"], w: Matrix | HeldLayer | SlicedLayer, native: bool, blocked: bool = True
) -> Float[Array, "*B T O"]:
    """x · wᵀ for a matrix as held (float or ggml blocks): the native block product on it where `runs_native`,
    else `linear` on it dequantized (inside the caller's layer loop: one matrix at a time). A layer of stacked
    blocks (`HeldLayer`) or floats (`SlicedLayer`): the native product reads it in place, XLA's a copy of it; of a
    `Mixed` stack, the product of the part that holds it (one branch of a switch runs)."""
    if isinstance(w, SlicedLayer):
        if runs_native(w.piece, x.dtype, native):
            return kernels.product(w.stack, x, w.index, piece=w.piece)  # [*B, T, O]
        return linear(x, w.piece, blocked)  # [*B, T, O]
    if isinstance(w, HeldLayer):

        def branch(k: int) -> Callable[[Float[Array, "*B T I"]], Float[Array, "*B T O"]]:
            if runs_native(w.parts[k], x.dtype, native):
                return lambda x: kernels.product(w.parts[k], x, w.index)
            return lambda x: linear(x, dense(w.take(k)), blocked)

        branches = [branch(k) for k in range(len(w.parts))]
        return branches[0](x) if len(branches) == 1 else lax.switch(w.part, branches, x)  # [*B, T, O]
    if runs_native(w, x.dtype, native):
        return kernels.product(w, x)  # [*B, T, O]
    return linear(x, dense(w), blocked)  # [*B, T, O]
