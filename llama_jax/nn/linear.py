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

The bfloat16 tier (`LlamaConfig.precision`) is decided here too: `tiered` rounds the activations of every weight
product to bf16 before the product, whichever product then runs; the weights are bf16-exact (bf16, or ggml's block
integers), so each term is exact in f32 and the tier's error is the activations' rounding alone.
"""

from __future__ import annotations

import dataclasses
import functools
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


@jax.custom_jvp
def bfloat16_rounded(x: Float[Array, "*A"]) -> Float[Array, "*A"]:
    """x rounded to the nearest bf16 (ties to even), in x's dtype. Its derivative is taken as 1 (a straight-through
    rounding): the bfloat16 tier's gradients are those of the products it ran, not of a step function's zeros."""
    return x.astype(jnp.bfloat16).astype(x.dtype)


@bfloat16_rounded.defjvp
def _bfloat16_rounded_jvp(primals, tangents):
    return bfloat16_rounded(primals[0]), tangents[0]


def tier_input(x: Float[Array, "*A I"], precision: str) -> Float[Array, "*A I"]:
    """What a weight product multiplies in a compute tier (`LlamaConfig.precision`): x in the float32 class, x rounded
    to bf16 in the bfloat16 tier (the LM head's input too, `nn.head`)."""
    return x if precision == "float32" else bfloat16_rounded(x)


def tiered(project: Project, precision: str) -> Project:
    """project in a compute tier: its activations as `tier_input` gives them (one rounding per call, shared by the
    matrices that read the same x)."""
    if precision == "float32":
        return project
    return lambda x, names: project(tier_input(x, precision), names)


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
    bf16_x: bool = False,
) -> Float[Array, "*B T O"]:
    """x · wᵀ for a matrix as held (float or ggml blocks): where `runs_native`, the native block product, or with
    step (static: one position per sequence, x [B, 1, I], as a prefill's or a decode step's LM head) the native
    matrix-vector product; else `linear` on it dequantized (one matrix at a time). A layer held as stored
    (`HeldLayer`) and a matrix alone held as blocks: `held_product`, whose gradient never keeps a widened copy. A
    layer of stacked floats (`SlicedLayer`): the native product reads it in place. bf16_x (static): x's values are
    bf16 (the bfloat16 tier's, `tiered`), which the native block product may use (`kernels.product`)."""
    if isinstance(w, HeldLayer):
        return held_product(x, w, native, blocked, bf16_x)
    if runs_native(w, x.dtype, native):
        if isinstance(w, SlicedLayer):
            return kernels.product(w.stack, x, w.index, piece=w.piece, bf16_x=bf16_x)  # [*B, T, O]
        if step:  # over the [1, O, I] view of w
            return kernels.matvec(jax.tree.map(lambda a: a[None], w), jnp.int32(0), x[:, 0])[:, None]  # [B, 1, O]
        return kernels.product(w, x, bf16_x=bf16_x)  # [*B, T, O]
    if isinstance(w, Blocks):  # as a stack of one, where it lies
        stack = HeldLayer((jax.tree.map(lambda a: a[None], w),), jnp.int32(0), jnp.int32(0))
        return held_product(x, stack, native, blocked, bf16_x)  # [*B, T, O]
    return linear(x, dense(w), blocked)  # [*B, T, O]


def held_product(
    x: Float[Array, "*B T I"], w: HeldLayer, native: bool, blocked: bool = True, bf16_x: bool = False
) -> Float[Array, "*B T O"]:
    """x · wᵀ for a layer held as stored, read where it lies: on the part that holds it (a `Mixed` stack's: one
    branch of a switch runs), by the native block product where it runs, else by `linear` on the layer widened.
    The weights held take no gradient (`research.gradients.weight_grads` widens those it differentiates); the
    gradient with respect to x is the transposed product on the same stored layer, widened again in the backward
    pass where XLA multiplies: so differentiating a layer loop keeps no widened copy and no copy of the stacks per
    layer (a `lax.switch` differentiated as such returns its branches' residuals, the whole stacks, from every
    layer: a Llama-3.1-8B Q4_K_M file's gradient asked for 46 GB). bf16_x: as `product` has it."""
    return _held((native, blocked, bf16_x), w.parts, w.part, w.index, x)


def _part_product(
    how: tuple[bool, bool, bool], stack: Matrix, index: Int[Array, ""], x: Array, transpose: bool
) -> Array:
    """x · Wᵀ (or x · W: transpose) for W = layer `index` of one stack of held weights."""
    native, blocked, bf16_x = how
    if runs_native(stack, x.dtype, native):
        if transpose:
            return kernels.transposed(stack, x, index)  # [*B, T, I]
        piece = None if isinstance(stack, Blocks) else stack[index]  # floats: the layer's own slice, unread
        return kernels.product(stack, x, index, piece=piece, bf16_x=bf16_x)  # [*B, T, O]
    w = dense(HeldLayer((stack,), jnp.int32(0), index))  # [O, I]: widened, this layer only
    if not transpose:
        return linear(x, w, blocked)  # [*B, T, O]
    shape = jax.ShapeDtypeStruct((*x.shape[:-1], w.shape[1]), x.dtype)
    return jax.linear_transpose(lambda a: linear(a, w, blocked), shape)(x)[0]  # [*B, T, I]: autodiff's own transpose


def _switched(how, parts, part, index, x, transpose):
    branches = [lambda x, k=k: _part_product(how, parts[k], index, x, transpose) for k in range(len(parts))]
    return lax.switch(part, branches, x)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _held(how: tuple[bool, bool, bool], parts: tuple[Matrix, ...], part: Array, index: Array, x: Array) -> Array:
    return _switched(how, parts, part, index, x, False)


def _held_fwd(how, parts, part, index, x):
    return _switched(how, parts, part, index, x, False), (parts, part, index)  # x: not needed (linear in x)


def _held_bwd(how, saved, g):
    parts, part, index = saved
    return None, None, None, _switched(how, parts, part, index, g, True)  # the held weights: no gradient


_held.defvjp(_held_fwd, _held_bwd)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WeightTaps:
    """Zeros whose gradients are chosen layers' weight gradients, for weights held as stored (a Q4_K_M 8B file's
    layers widened to f32 at once take 28 GB). One [C, O, I] f32 array per matrix of the layers and each layer's
    slot among the C chosen (static; -1: not chosen). The layer loop taps each product
    x · Wᵀ of a chosen layer (`tap`): the forward pass is unchanged, and the backward pass gives the tap the
    product's weight gradient gᵀ · x at its slot, computed from that layer's own x and g; no weight is widened
    for it and the stored weights take no gradient (`held_product`)."""

    q: Float[Array, "C M D"]
    k: Float[Array, "C _C D"]
    v: Float[Array, "C _C D"]
    o: Float[Array, "C D M"]
    gate: Float[Array, "C F D"]
    up: Float[Array, "C F D"]
    down: Float[Array, "C D F"]
    slots: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    @staticmethod
    def zeros(layers: LayerWeights, chosen: tuple[int, ...]) -> WeightTaps:
        """Taps of zeros on every matrix of the chosen layers (distinct indices, in the order given)."""
        count = getattr(layers, arrays.LAYER_MATRICES[0]).shape[0]
        slots = tuple(chosen.index(i) if i in chosen else -1 for i in range(count))
        shapes = {f: (len(chosen), *getattr(layers, f).shape[1:]) for f in arrays.LAYER_MATRICES}
        return WeightTaps(**{f: jnp.zeros(shape, jnp.float32) for f, shape in shapes.items()}, slots=slots)

    def tap(self, project: Project, layer: Int[Array, ""], native: bool) -> Project:
        """project, with each product by a tapped matrix tapped at layer `layer`'s slot."""
        slot = jnp.asarray(self.slots, jnp.int32)[layer]

        def tapped(x: Float[Array, "B T I"], names: tuple[str, ...]) -> tuple[Float[Array, "B T O"], ...]:
            ys = project(x, names)
            return tuple(_tap((native,), y, x, getattr(self, n), slot) for n, y in zip(names, ys, strict=True))

        return tapped


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tap(how: tuple[bool], y: Array, x: Array, probe: Array, slot: Array) -> Array:
    return y


def _tap_fwd(how, y, x, probe, slot):
    return y, (x, slot, probe)  # the probe: the loop's constant, not a copy per layer


def _tap_bwd(how, saved, g):
    x, slot, probe = saved
    (native,) = how

    def at_slot() -> Array:
        if native and x.dtype == g.dtype == jnp.float32:
            grad = kernels.weight_grad(g, x)  # [O, I]
        else:
            rows = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
            grad = jnp.einsum("ro,ri->oi", *rows, precision=lax.Precision.HIGHEST)  # [O, I]
        return jnp.zeros_like(probe).at[slot].set(grad.astype(probe.dtype))  # [C, O, I]

    return g, None, lax.cond(slot >= 0, at_slot, lambda: jnp.zeros_like(probe)), None


_tap.defvjp(_tap_fwd, _tap_bwd)


@dataclasses.dataclass(frozen=True)
class LayerProducts:
    """How a pass's layer loop multiplies by each layer's matrices, as the pass states it: the stacked weights,
    native (static: the native kernels) and step (static: one position per sequence against a cache, a decode
    step). The loop scans `scanned()` and asks `layer` for layer i's weights and its products; taps: products
    tapped for chosen layers' weight gradients (`WeightTaps`).

    A decode step's products are the native matrix-vector kernel's, reading layer i in place from the stacks, a
    layer's matrices held in one kind in one call (`kernels.matvecs`: q, k and v one hand-off to the threads);
    a `Mixed` matrix's layer from the part that holds it, alone. Otherwise `product`, on layer i as it lies:
    stacked blocks (`HeldLayer`), and for the native kernels the float stacks too (`SlicedLayer`: the scan's own
    slice takes the weight gradient, the kernel reads the stack). precision: the compute tier (`tiered`, the
    outermost wrapper: the taps and every product see the x rounded once)."""

    layers: LayerWeights
    native: bool
    step: bool
    taps: WeightTaps | None = None
    precision: str = "float32"

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
            return lw, _biased(tiered(_matvecs(self.layers, i), self.precision), lw)
        project = _products(lw, self.native, self.precision != "float32")
        tapped = project if self.taps is None else self.taps.tap(project, i, self.native)
        return lw, _biased(tiered(tapped, self.precision), lw)  # a tap sees the rounded x its product took


def projection(lw: LayerWeights, native: bool = False, precision: str = "float32") -> Project:
    """Products by a layer's own weights, as held, each plus its bias where the layer has one: `product` (native,
    static: the native block product where it runs), one matrix at a time, in the compute tier `precision`."""
    return _biased(tiered(_products(lw, native, precision != "float32"), precision), lw)


def _products(lw: LayerWeights, native: bool, bf16_x: bool) -> Project:
    def project(x: Float[Array, "B T I"], names: tuple[str, ...]) -> tuple[Float[Array, "B T O"], ...]:
        return tuple(product(x, getattr(lw, name), native, bf16_x=bf16_x) for name in names)

    return project


def _biased(project: Project, lw: LayerWeights) -> Project:
    """project, each product plus its matrix's bias (one layer's, [O]) where the layer has one (`config.biases`):
    added after the whole product, as nn.Linear adds it; a weight's tapped gradient is the product's, before it."""

    def biased(x: Float[Array, "B T I"], names: tuple[str, ...]) -> tuple[Float[Array, "B T O"], ...]:
        ys = project(x, names)
        return tuple(
            y if lw.bias(n) is None else y + lw.bias(n).astype(y.dtype) for n, y in zip(names, ys, strict=True)
        )

    return biased


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
