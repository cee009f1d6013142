"""The one matrix product of the model: x · Wᵀ with W stored [out, in] (PyTorch's nn.Linear), in f32.

Accuracy: XLA CPU's matrix-matrix product accumulates the whole inner dimension in one running sum, about four
times the rounding error of PyTorch's (MKL's) for in = 1536, and a residual stream amplifies it: the activations
drifted from transformers' by several times the 1e-4 tolerance. So a block of positions sums the inner dimension
in blocks of ACC_BLOCK numbers, each block's product rounded once and the partial products added pairwise, which
brings the error to PyTorch's level (measured against float64; blocks of 384 or 768 did not). One position at
a time (decode) takes XLA's
matrix-vector path, whose error is already that small. The product runs in the activations' dtype (f32; f64 in
gradient checks): a bf16 weight is widened to it exactly before the product.

`product` (one matrix: the LM head, a logit lens) and `LayerProducts` (a layer loop's matrices) are where a pass's
"native or XLA?" becomes a choice of product for every matrix: the native block product, the native matrix-vector
product of a decode step, or XLA's. A pass says only what it computes (native kernels or not; one position per
sequence against a cache or a block); this module is the one place that decides how.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from llama_jax import kernels
from llama_jax.core import arrays
from llama_jax.core.quantized import Blocks, HeldLayer, Matrix, Mixed, SlicedLayer, dense, kind
from llama_jax.core.weights import LayerWeights
from llama_jax.nn.invariant import matmul_t

ACC_BLOCK = 192

# x [B, T, in] and names of a layer's matrices (of x's inputs) -> x · Wᵀ for each (`LayerProducts.layer`)
Project = Callable[[Array, tuple[str, ...]], tuple[Array, ...]]


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


def runs_native(w: Matrix | HeldLayer | SlicedLayer, dtype: jnp.dtype | type, native: bool) -> bool:
    """Whether x · wᵀ runs on the native kernels: a pass running them (`native`, a Model's decision), on a matrix
    held in a kind they multiply, with activations of this dtype (`kernels.multiplies`: f64 activations, as in
    gradient checks, take XLA's products). A layer in place: its matrix (a `Mixed` stack's: one part's)."""
    matrix = w.piece if isinstance(w, SlicedLayer) else w.parts[0] if isinstance(w, HeldLayer) else w
    return native and kernels.multiplies(matrix, dtype)


def product(
    x: Float[Array, "*B T I"],
    w: Matrix | HeldLayer | SlicedLayer,
    native: bool,
    blocked: bool = True,
    step: bool = False,
) -> Float[Array, "*B T O"]:
    """x · wᵀ for a matrix as held (float or ggml blocks): where `runs_native`, the native block product, or with
    step (static: one position per sequence, x [B, 1, I], as a prefill's or a decode step's LM head) the native
    matrix-vector product; else `linear` on it dequantized (inside the caller's layer loop: one matrix at a
    time). A layer of stacked blocks (`HeldLayer`) or floats (`SlicedLayer`): the native product reads it in
    place, XLA's a copy of it; of a `Mixed` stack, the product of the part that holds it (one branch of a switch
    runs)."""
    if isinstance(w, HeldLayer) and len(w.parts) > 1:
        branches = [lambda x, k=k: product(x, w.alone(k), native, blocked) for k in range(len(w.parts))]
        return lax.switch(w.part, branches, x)  # [*B, T, O]
    if runs_native(w, x.dtype, native):
        if isinstance(w, SlicedLayer):
            return kernels.product(w.stack, x, w.index, piece=w.piece)  # [*B, T, O]
        if isinstance(w, HeldLayer):
            return kernels.product(w.parts[0], x, w.index)  # [*B, T, O]
        if step:  # over the [1, O, I] view of w
            return kernels.matvec(jax.tree.map(lambda a: a[None], w), jnp.int32(0), x[:, 0])[:, None]  # [B, 1, O]
        return kernels.product(w, x)  # [*B, T, O]
    return linear(x, dense(w), blocked)  # [*B, T, O]


@dataclasses.dataclass(frozen=True)
class LayerProducts:
    """How a pass's layer loop multiplies by each layer's matrices, as the pass states it: the stacked weights,
    native (static: the native kernels) and step (static: one position per sequence against a cache, a decode
    step). The loop scans `scanned()` and asks `layer` for layer i's weights and its products.

    A decode step's products are the native matrix-vector kernel's, reading layer i in place from the stacks, a
    layer's matrices held in one kind in one call (`kernels.matvecs`: q, k and v one hand-off to the threads);
    a `Mixed` matrix's layer from the part that holds it, alone. Otherwise `product`, on layer i as it lies:
    stacked blocks (`HeldLayer`), and for the native kernels the float stacks too (`SlicedLayer`: the scan's own
    slice takes the weight gradient, the kernel reads the stack)."""

    layers: LayerWeights
    native: bool
    step: bool

    def held(self) -> dict[str, Blocks | Mixed]:
        """The matrices held as ggml blocks, by field: read in place, never sliced by the scan."""
        return {f: m for f in arrays.LAYER if isinstance(m := getattr(self.layers, f), Blocks | Mixed)}

    def scanned(self) -> LayerWeights:
        """The weights the layer scan slices: every float array (the held blocks None)."""
        return dataclasses.replace(self.layers, **dict.fromkeys(self.held()))

    def layer(self, lw: LayerWeights, i: Int[Array, ""]) -> tuple[LayerWeights, Project]:
        """Layer i's weights (lw: the scan's slice of `scanned()`), each matrix as the products read it, and how
        x is multiplied by them."""
        held = self.held()
        in_place = {}
        if self.native and not self.step:  # the float matrices read in place from their stacks
            floats = [f for f in arrays.LAYER_MATRICES if f not in held]
            in_place = {f: SlicedLayer(getattr(lw, f), getattr(self.layers, f), i) for f in floats}
        lw = dataclasses.replace(lw, **{f: m.at(i) for f, m in held.items()}, **in_place)
        if self.native and self.step:
            return lw, _matvecs(self.layers, i)
        return lw, projection(lw, self.native)


def projection(lw: LayerWeights, native: bool = False) -> Project:
    """Products by a layer's own weights, as held: `product` (native, static: the native block product where it
    runs), one matrix at a time."""

    def project(x: Float[Array, "B T I"], names: tuple[str, ...]) -> tuple[Float[Array, "B T O"], ...]:
        return tuple(product(x, getattr(lw, name), native) for name in names)

    return project


def _matvecs(stacked: LayerWeights, layer: Int[Array, ""]) -> Project:
    """Products of one position per sequence by layer `layer`'s weights, read in place from the stacks by the
    native matrix-vector kernel: the named matrices held in one kind in one call; a `Mixed` matrix's layer from
    the part that holds it, alone."""

    def project(x: Float[Array, "B 1 I"], names: tuple[str, ...]) -> tuple[Float[Array, "B 1 O"], ...]:
        out: dict[str, Array] = {}
        together: dict[str, list[str]] = {}  # kind -> the names held in it, not Mixed
        for name in names:
            w = getattr(stacked, name)
            if isinstance(w, Mixed):  # the part that holds this layer, at its index there
                at = w.at(layer)
                branches = [lambda x, p=p, i=at.index: kernels.matvec(p, i, x) for p in w.parts]
                out[name] = lax.switch(at.part, branches, x[:, 0])  # [B, O]
            else:
                together.setdefault(kind(w), []).append(name)
        for group in together.values():
            ys = kernels.matvecs([getattr(stacked, name) for name in group], layer, x[:, 0])  # each [B, O]
            out.update(zip(group, ys, strict=True))
        return tuple(out[name][:, None] for name in names)  # each [B, 1, O]

    return project
