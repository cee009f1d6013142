"""Native CPU kernels called from jitted code through XLA's FFI (see matvec.cc, attention.cc and products.cc for why
each exists and for their contracts: batch invariance, and progress on any thread pool):

- `matvec(w, layer, x)`: a decode step's x · w[layer]ᵀ (`matvecs`: several of a layer's matrices in one call),
  read straight from the stacked weights (f32, bf16, f16, or ggml's Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 blocks widened to
  their exact f32 values; the Q4_K, Q5_K, Q6_K super-blocks' integer quants times int8 limbs of x, exactly
  (`LIMBS`, limbs.h): one trait each in held.h);
- `attend(k, v, layer, last, q)`: one query position per sequence against the cache, read in place;
- `attend_block(q, k, v, positions)`: causal attention of a block of query positions, computing only the slots
  at or before each query's position; `attend_block_grads` its gradient;
- `product(w, x)`: x · wᵀ for a block of positions (prefill, scoring, `forward`) on one matrix held in any of
  those kinds, widened panel by panel inside the product; differentiable (its VJP is the transposed product,
  `transposed(w, g)`, which a caller's own VJP can run alone);
- `score_head(w, x, targets)`: scoring's LM head and log-softmax at the scored rows only, blocked over the
  vocabulary (no [rows, vocab] array);
- `tile_product_reference(w, x)`: the arithmetic of `product`'s AMX tiles (the "amx" variant: bf16 weights, each
  activation split into three bf16 terms; and ggml's blocks of 32 in TILE_BLOCKS, d · Σ q·x + m · Σ x; tiles.h) in
  plain C++, on every CPU.

Their speed parameters (tile shapes, prefetch distances, pieces per thread) are chosen for the CPU that runs them
(`tuning`), never changing a result's bits.

They are compiled when the package is installed (setup.py: one library of every kernel per instruction-set variant,
`_kernels_amx`, `_kernels_avx512`, `_kernels_avx2`) and chosen at run time (`library.status`): LLAMA_JAX_NATIVE=auto
(the default) runs them where they can run and XLA's own products elsewhere (the same numbers to float rounding,
slower), off never runs them, require raises NativeKernelError where they cannot run. A Model decides once
(`Model.native`) and passes the answer down as a plain bool; call these functions only where it is True.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from llama_jax.core.quantized import BY_NAME, Blocks, Matrix, kind
from llama_jax.errors import NativeKernelError
from llama_jax.kernels.library import (
    ATTEND,
    ATTEND_BLOCK,
    ATTEND_BLOCK_GRADS,
    BLOCK_TILE_REFERENCE,
    LIMBS,
    MATVEC,
    PRODUCT,
    SCORE_HEAD,
    TILE_BLOCKS,
    TILE_PRODUCT_REFERENCE,
    WEIGHT_GRAD,
    NativeStatus,
    status,
)
from llama_jax.kernels.tuning import MatvecTuning, ProductTuning, chosen

__all__ = [
    "LIMBS",
    "TILE_BLOCKS",
    "MatvecTuning",
    "NativeStatus",
    "attend",
    "attend_block",
    "attend_block_grads",
    "matvec",
    "matvecs",
    "multiplies",
    "product",
    "score_head",
    "status",
    "tile_product_reference",
    "transposed",
    "weight_grad",
]


def _require_loaded() -> None:
    if not status("auto").active:
        raise NativeKernelError(f"a native kernel was called, but {status('auto')}; pass native=False")


def matvec(
    w: Float[Array, "L O I"] | Blocks,
    layer: Int[Array, ""],
    x: Float[Array, "B I"],
    tuning: MatvecTuning | None = None,
) -> Float[Array, "B O"]:
    """x · w[layer]ᵀ in f32, for weights held in any of the kinds in `library.MATVEC`. tuning: the speed parameters
    (default: this machine's, `tuning.chosen`); any set gives the same bits."""
    return matvecs((w,), layer, x, tuning)[0]


def matvecs(
    ws: Sequence[Float[Array, "L _O I"] | Blocks],
    layer: Int[Array, ""],
    x: Float[Array, "B I"],
    tuning: MatvecTuning | None = None,
) -> tuple[Float[Array, "B _O"], ...]:  # O: each matrix's own
    """x · w[layer]ᵀ for each w of ws (held in one kind, of x's inputs) in one call: their rows one pool of work for
    the threads (a layer's q, k and v: one hand-off instead of three). Each result has the bits `matvec` gives."""
    _require_loaded()
    kinds = {kind(w) for w in ws}
    if len(kinds) != 1 or any(w.shape[-1] != x.shape[-1] for w in ws):
        raise NativeKernelError(f"matvecs multiplies matrices of one kind and x's {x.shape[-1]} inputs; got {kinds}")
    tuning = tuning or chosen().matvec
    if min(tuning.ahead_small, tuning.ahead_large) < 0 or tuning.items_per_thread < 1:
        raise NativeKernelError(f"matvec tuning {tuning}: the aheads must be ≥ 0 and items_per_thread ≥ 1")
    out = tuple(jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32) for w in ws)
    call = jax.ffi.ffi_call(MATVEC[kinds.pop()], out)
    data = [w.blocks if isinstance(w, Blocks) else w for w in ws]
    return tuple(call(jnp.asarray(layer, jnp.int32), x.astype(jnp.float32), *data, **tuning.attributes()))


def attend(
    k: Float[Array, "L B K S H"],
    v: Float[Array, "L B K S H"],
    layer: Int[Array, ""],
    last: Int[Array, " B"],
    q: Float[Array, "B N H"],
    sliding_window: int | None = None,
    scale: float | None = None,
) -> Float[Array, "B N H"]:
    """softmax(q · kᵀ · scale) · v of one query per sequence over cache slots 0..last[b] of layer `layer` (the
    last sliding_window of them, where given), each query head j·G + i against key/value head j (f32 caches).
    scale: 1/sqrt(H) (rounded to f32) unless given."""
    _require_loaded()
    call = jax.ffi.ffi_call(ATTEND, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    window = np.int64(sliding_window or 0)  # 0: every slot
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    return call(k, v, jnp.asarray(layer, jnp.int32), last, q, window=window, scale=_scale(scale, q))


def attend_block(
    q: Float[Array, "*B T N H"],
    k: Float[Array, "*B K S H"],
    v: Float[Array, "*B K S H"],
    positions: Int[Array, "*B T"],
    sliding_window: int | None = None,
    scale: float | None = None,
) -> Float[Array, "*B T N H"]:
    """softmax(q · kᵀ · scale) · v of every query position t over the key slots 0..positions[t] (the last
    sliding_window of them, where given; each query head j·G + i against key/value head j; f32; scale: 1/sqrt(H)
    unless given). Not
    differentiable by itself: `nn.attention` gives it a VJP. vmap-able (a vmapped call's batch folds into the
    sequences)."""
    _require_loaded()
    call = jax.ffi.ffi_call(ATTEND_BLOCK, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="broadcast_all")
    return call(q, k, v, positions.astype(jnp.int32), window=np.int64(sliding_window or 0), scale=_scale(scale, q))


def attend_block_grads(
    q: Float[Array, "*B T N H"],
    k: Float[Array, "*B K S H"],
    v: Float[Array, "*B K S H"],
    positions: Int[Array, "*B T"],
    out: Float[Array, "*B T N H"],
    g: Float[Array, "*B T N H"],
    sliding_window: int | None = None,
    scale: float | None = None,
) -> tuple[Float[Array, "*B T N H"], Float[Array, "*B K S H"], Float[Array, "*B K S H"]]:
    """The gradients of `attend_block`'s output (`out`) with respect to q, k and v given g, the output's gradient,
    computing only the slots each query reads (f32 class: the probabilities recomputed; a key slot no query reads
    gets 0). vmap-able."""
    _require_loaded()
    shapes = (q.shape, k.shape, v.shape)
    result = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes)
    call = jax.ffi.ffi_call(ATTEND_BLOCK_GRADS, result, vmap_method="broadcast_all")
    window = np.int64(sliding_window or 0)
    return call(q, k, v, positions.astype(jnp.int32), out, g, window=window, scale=_scale(scale, q))


def _scale(scale: float | None, q: Array) -> np.float32:
    """The attention scores' scale as the kernels take it: given, or 1/sqrt(H) in float64 rounded to f32."""
    return np.float32(1.0 / np.sqrt(q.shape[-1]) if scale is None else scale)


def multiplies(w: Matrix, dtype: jnp.dtype | type) -> bool:
    """Whether `product` multiplies activations of this dtype by this weight: a kind in `library.PRODUCT` (f64
    weights, as in gradient checks, take XLA's products) and f32 activations."""
    return kind(w) in PRODUCT and jnp.dtype(dtype) == jnp.float32


def product(
    w: Matrix,
    x: Float[Array, "*A I"],
    layer: Int[Array, ""] | None = None,
    tuning: ProductTuning | None = None,
    piece: Float[Array, "O I"] | None = None,
    bf16_x: bool = False,
) -> Float[Array, "*A O"]:
    """x · wᵀ in f32 for one matrix w [O, I] (a layer's, or the LM head), any number of rows; or, given `layer`,
    for layer `layer` of stacked weights w [L, O, I], read where it lies: blocks (`HeldLayer`), or floats given
    `piece`, the same layer as the layer loop's own slice w[layer] (`SlicedLayer`), which takes the weight
    gradient (the stack takes none). Differentiable: the gradient with respect to x is the transposed product on
    the same stored weights, with respect to float weights gᵀ · x (both native). vmap-able over x (the rows of
    every example run as one product). tuning: the speed parameters (default: this machine's, `tuning.chosen`); any
    set gives the same bits. bf16_x (static): x's values are bf16 already (the bfloat16 tier rounds them), so the
    AMX tiles take one bf16 term of each instead of three (the same values: the other two are zeros); no other
    kernel reads it."""
    _require_loaded()
    if layer is not None and not isinstance(w, Blocks) and piece is None:
        raise NativeKernelError(
            f"product(w, x, layer) of stacked float weights w {w.shape} needs piece=w[layer] (the layer loop's own "
            "slice, which takes the weight gradient); for one matrix, product(w[layer], x)"
        )
    if piece is not None and (
        layer is None or isinstance(w, Blocks) or (piece.shape, piece.dtype) != (w.shape[1:], w.dtype)
    ):
        raise NativeKernelError(
            f"piece {piece.shape} {piece.dtype} is not layer `layer` of stacked float weights w {w.shape} {w.dtype}: "
            "pass piece=w[layer] with a layer (blocks take no piece)"
        )
    tuning = tuning or chosen().product
    if tuning.large_x_bytes < 0:
        raise NativeKernelError(f"product tuning {tuning}: large_x_bytes must be ≥ 0")
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    if piece is not None:
        how = (kind(w), tuning, bf16_x)
        return _product_in_place(how, piece, jax.lax.stop_gradient(w), index, x.astype(jnp.float32))
    data = w.blocks if isinstance(w, Blocks) else w  # a matrix alone stays as it is: see `_call`
    return _product((kind(w), tuning, bf16_x), data, index, x.astype(jnp.float32))


def transposed(
    w: Matrix, g: Float[Array, "*A O"], layer: Int[Array, ""] | None = None, tuning: ProductTuning | None = None
) -> Float[Array, "*A I"]:
    """g · w in f32, the transposed product (`product`'s gradient with respect to x, the same bits), for one matrix
    w [O, I] or layer `layer` of stacked weights w [L, O, I], blocks or floats, read where it lies. Not
    differentiable: for a VJP that takes no weight gradient (`nn.linear`'s layers held as stored)."""
    _require_loaded()
    index = jnp.asarray(0 if layer is None else layer, jnp.int32)
    data = w.blocks if isinstance(w, Blocks) else w
    return _call((kind(w), tuning or chosen().product, False), data, index, g.astype(jnp.float32), True)


def score_head(
    w: Matrix,
    x: Float[Array, "*A D"],
    targets: Int[Array, "*A"],
    keep: Int[Array, " R"] | None = None,
    divisor: float = 1.0,
) -> tuple[Float[Array, "*A"], Int[Array, "*A"], Float[Array, "*A"], Float[Array, "*A"], Float[Array, "R V"]]:
    """For every row of x whose target is not -1 (the others: 0, -1, 0, 0, not computed), with logits x · wᵀ:
    the target's log-probability (logit - M) - log S, the argmax, M (the largest logit) and log S (S = Σ exp(logit
    - M)); and the logits of the rows `keep` names (indices into x's rows flattened, ascending, each scored), so
    that (logits - M) - log S are their whole vocabulary's log-probabilities in the same bits, from the same pass
    over the head. w [V, D] is the LM head as held (a kind `multiplies` accepts). divisor: each logit is x · wᵀ
    divided by it (the config's logits_scaling; 1: no division). Not differentiable."""
    _require_loaded()
    keep = jnp.zeros(0, jnp.int32) if keep is None else keep.astype(jnp.int32)
    f32, i32 = jax.ShapeDtypeStruct(targets.shape, jnp.float32), jax.ShapeDtypeStruct(targets.shape, jnp.int32)
    out = (f32, i32, f32, f32, jax.ShapeDtypeStruct((keep.shape[0], w.shape[0]), jnp.float32))
    call = jax.ffi.ffi_call(SCORE_HEAD[kind(w)], out)
    data = w.blocks if isinstance(w, Blocks) else w
    return call(data, x.astype(jnp.float32), targets.astype(jnp.int32), keep, divisor=np.float32(divisor))


Product = tuple[str, ProductTuning, bool]  # how a product runs: the kind held, the tuning, bf16_x (see `product`)


def _call(how: Product, data: Array, layer: ArrayLike, x: Array, transpose: bool) -> Array:
    """The FFI call: x · Wᵀ, or x · W (transpose), W [O, I] layer `layer` of `data` [L, O, I] held as `held`
    (blocks: [L, O, I / VALUES, bytes]), or W = data, a matrix alone, as a stack of one. A matrix alone reaches
    the custom VJP unexpanded: inside a caller's layer scan it is the scan's own slice of the stacked weights, which
    the scan's differentiation then forwards to the backward pass instead of stacking a copy of every layer's
    weights as residuals (`run_layers` reads a layer in place instead: `SlicedLayer`). how: (held, the tuning,
    bf16_x: of x, never of a transposed product's g)."""
    held, tuning, bf16_x = how
    blocks = jnp.issubdtype(data.dtype, jnp.integer)
    if data.ndim == (3 if blocks else 2):
        data = data[None]  # [1, O, I (/ VALUES, bytes)]
    o, i = (data.shape[-3], data.shape[-2] * BY_NAME[held].VALUES) if blocks else data.shape[-2:]
    out = jax.ShapeDtypeStruct((*x.shape[:-1], i if transpose else o), jnp.float32)
    # vmap: the unbatched weights and index get leading dimensions of 1, which the kernel accepts; x's fold into
    # its rows
    call = jax.ffi.ffi_call(PRODUCT[held], out, vmap_method="expand_dims")
    return call(data, layer, x, transpose=transpose, bf16_x=bf16_x and not transpose, **tuning.attributes())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _product(how: Product, data: Array, layer: ArrayLike, x: Array) -> Array:
    return _call(how, data, layer, x, False)


def _product_fwd(how: Product, data: Array, layer: ArrayLike, x: Array) -> tuple[Array, tuple[Array, ArrayLike, Array]]:
    return _call(how, data, layer, x, False), (data, layer, x)


def _product_bwd(
    how: Product, saved: tuple[Array, ArrayLike, Array], g: Array
) -> tuple[Array | np.ndarray, np.ndarray, Array]:
    data, layer, x = saved
    dx = _call(how, data, layer, g, True)  # [*A, I]
    no_index = np.zeros(layer.shape, jax.dtypes.float0)
    if not jnp.issubdtype(data.dtype, jnp.floating):  # blocks: integers, no gradient
        return np.zeros(data.shape, jax.dtypes.float0), no_index, dx
    return weight_grad(g, x).reshape(data.shape).astype(data.dtype), no_index, dx


def weight_grad(g: Float[Array, "*A O"], x: Float[Array, "*A I"]) -> Float[Array, "O I"]:
    """gᵀ · x summed over every row (a product's gradient with respect to its weights): products.cc's WeightGrad,
    a straight f32 sum over the rows (XLA's dot, with its transposed copies of g and x, ran a 256-token weight
    gradient 2-7% slower on a Zen 4). vmap-able: under vmap (per-example gradients) each example's sum is its
    own."""
    _require_loaded()
    out = jax.ShapeDtypeStruct((g.shape[-1], x.shape[-1]), jnp.float32)  # [O, I]
    call = jax.ffi.ffi_call(WEIGHT_GRAD, out, vmap_method="broadcast_all")
    return call(g.astype(jnp.float32), x.astype(jnp.float32))


_product.defvjp(_product_fwd, _product_bwd)


def tile_product_reference(w: Float[Array, "O I"] | Blocks, x: Float[Array, "R I"]) -> Float[Array, "R O"]:
    """x · wᵀ as the "amx" variant's tiles compute it, in plain C++ on any CPU: the reference its tests hold the
    tiles and float64 against. bf16 weights w [O, I]: each x split exactly into three bf16 terms, every product exact,
    summed in f32 in steps of 32 inner indices (tiles.h). ggml's blocks of 32 (Q4_0, Q4_1, Q8_0; one matrix [O, I /
    32] of blocks): per block d · Σ q·x (+ m · Σ x), Σ q·x of the same terms by the block's integers. Not the tiles'
    bits (the hardware sums a tile product in its own order): the same arithmetic and class."""
    _require_loaded()
    if isinstance(w, Blocks):
        if kind(w) not in TILE_BLOCKS or w.blocks.ndim != 3 or x.ndim != 2 or w.shape[1] != x.shape[1]:
            raise NativeKernelError(
                f"tile_product_reference takes {', '.join(sorted(TILE_BLOCKS))} blocks [O, I / 32] and x [R, I], not"
                f" {kind(w)} {w.shape} and {x.shape}"
            )
        out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
        call = jax.ffi.ffi_call(BLOCK_TILE_REFERENCE, out)
        return call(w.blocks, x.astype(jnp.float32), ggml_type=np.int64(w.GGML_TYPE))
    if w.ndim != 2 or x.ndim != 2 or w.dtype != jnp.bfloat16 or w.shape[1] != x.shape[1]:
        raise NativeKernelError(
            f"tile_product_reference takes bf16 w [O, I] and x [R, I], not {w.shape} {w.dtype} and {x.shape}"
        )
    out = jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32)
    return jax.ffi.ffi_call(TILE_PRODUCT_REFERENCE, out)(w, x.astype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _product_in_place(how: Product, piece: Array, stack: Array, layer: ArrayLike, x: Array) -> Array:
    """x · stack[layer]ᵀ read in place; piece (= stack[layer], unread: a slice the compiler then never copies) takes
    the weight gradient."""
    return _call(how, stack, layer, x, False)


def _product_in_place_fwd(
    how: Product, piece: Array, stack: Array, layer: ArrayLike, x: Array
) -> tuple[Array, tuple[Array, ArrayLike, Array]]:
    return _call(how, stack, layer, x, False), (stack, layer, x)


def _product_in_place_bwd(
    how: Product, saved: tuple[Array, ArrayLike, Array], g: Array
) -> tuple[Array, None, np.ndarray, Array]:
    stack, layer, x = saved
    dx = _call(how, stack, layer, g, True)  # [*A, I]
    dw = weight_grad(g, x).astype(stack.dtype)  # [O, I]: the piece's
    return dw, None, np.zeros(layer.shape, jax.dtypes.float0), dx


_product_in_place.defvjp(_product_in_place_fwd, _product_in_place_bwd)
