"""The block products of bf16 weights, and of ggml's blocks of 32 (Q4_0, Q4_1, Q8_0), on AMX tiles (the "amx"
variant, tiles.h): each activation split exactly into three bf16 terms, every product exact (a block's integers are
exact in bf16; its d and m scale each step's sum in f32), so the f32 class by construction. Their laws: the split
loses nothing (the identity matrix gives every x back, bit for bit), f32 class against float64 on odd shapes and a
model's, every row the same bits whatever the rows around it, and within the class of the plain C++ reference of the
same arithmetic, which runs on every CPU (where no AMX exists, only its laws are checked)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax import kernels
from llama_jax.core.quantized import BY_NAME, dense
from tests.gguf_builder import finite_blocks
from tests.helpers import relative_error, straight_sum_error

pytestmark = pytest.mark.skipif(not kernels.status().active, reason=str(kernels.status()))
TILES = kernels.status().variant == "amx"
needs_tiles = pytest.mark.skipif(not TILES, reason=f"no AMX tiles here ({kernels.status()})")

SHAPES = [(1, 32, 32), (5, 64, 96), (13, 33, 224), (37, 192, 577), (130, 70, 416), (600, 40, 1100)]  # rows, out,
# in: odd tiles, a slab of 512 rows and more, more than a chunk of 1024 inner indices


def operands(rows: int, out: int, inner: int, seed: int) -> tuple[jax.Array, np.ndarray, np.ndarray]:
    """bf16 weights [out, inner], their values in float64, and x [rows, inner] spanning 2^-40..2^40."""
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((out, inner)) * 0.05, jnp.bfloat16)
    x = rng.standard_normal((rows, inner)) * np.exp2(rng.integers(-40, 40, (rows, 1)))
    return w, np.asarray(w.astype(jnp.float32), np.float64), x.astype(np.float32)


def widely_spread(rows: int, inner: int, seed: int) -> np.ndarray:
    """f32 values of every exponent from 2^-100 to 2^100 and random significands: every bit of each counts."""
    rng = np.random.default_rng(seed)
    significands = rng.uniform(1, 2, (rows, inner)) * rng.choice([-1, 1], (rows, inner))
    return (significands * np.exp2(rng.integers(-100, 100, (rows, inner)))).astype(np.float32)


# x · Wᵀ and the transposed g · W (the gradient with respect to x), on the tiles and by the reference (g · W is
# g · (Wᵀ)ᵀ: the reference of W's transpose)
PRODUCTS = {
    "reference": kernels.tile_product_reference,
    "reference, transposed": lambda w, g: kernels.tile_product_reference(w.T, g),
    "tiles": kernels.product,
    "tiles, transposed": kernels.transposed,
}
MULTIPLY = [name if name.startswith("reference") else pytest.param(name, marks=needs_tiles) for name in PRODUCTS]


@pytest.mark.parametrize("multiply", MULTIPLY)
def test_the_identity_gives_every_activation_back_bit_for_bit(multiply):
    """x · I = x: hi + mid + lo is x exactly (24 bits, 8 a term), each term times 1 exact, the zeros exact."""
    x = widely_spread(19, 96, seed=1)
    eye = jnp.eye(96, dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(PRODUCTS[multiply](eye, jnp.asarray(x))), x)


@pytest.mark.parametrize("multiply", MULTIPLY)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_product_is_f32_class_against_float64(multiply, shape):
    """Within 2× the error of a straight f32 sum, against the float64 product of the same values (transposed: g
    [rows, out] · W [out, in])."""
    rows, out, inner = shape
    w, wv, x = operands(rows, out, inner, seed=rows)
    b = wv.T
    if multiply.endswith("transposed"):  # g [rows, out] · W [out, inner]
        x, b = operands(rows, inner, out, seed=rows + 1)[2], wv
    exact = x.astype(np.float64) @ b
    got = jax.jit(PRODUCTS[multiply])(w, jnp.asarray(x))
    error, straight = relative_error(got, exact), straight_sum_error(x, b, exact)
    assert error <= 2 * straight, (error, straight)


@needs_tiles
@pytest.mark.parametrize("shape", [(512, 576, 576), (64, 1536, 576), (64, 576, 1536)], ids=["qo", "up", "down"])
def test_the_tiles_are_f32_class_at_a_models_shapes_and_beside_the_reference(shape):
    """SmolLM2-135M's matrices: f32 class against float64, and no farther from the reference than that."""
    w, wv, x = operands(*shape, seed=7)
    exact = x.astype(np.float64) @ wv.T
    straight = straight_sum_error(x[:8], wv.T, exact[:8])
    tiles = kernels.product(w, jnp.asarray(x))
    assert relative_error(tiles, exact) <= 2 * straight
    reference = np.asarray(kernels.tile_product_reference(w, jnp.asarray(x)), np.float64)
    assert relative_error(tiles, reference) <= 4 * straight


@needs_tiles
@pytest.mark.parametrize("multiply", ["tiles", "tiles, transposed"])
def test_a_row_is_the_same_bits_alone_and_among_any_rows(multiply):
    """Rows 0..69 alone, and in blocks of every size at the start and at the end: the same bits (row tiles of 32
    rows, padded; column pairs and threads: none changes a row's order)."""
    w, _, x = operands(70, 96, 160, seed=5)
    f = jax.jit(PRODUCTS[multiply])
    if multiply.endswith("transposed"):
        x = x[:, :96]  # g [rows, out]
    alone = np.concatenate([np.asarray(f(w, jnp.asarray(x[r : r + 1]))) for r in range(70)])
    for count in (2, 16, 31, 33, 45, 70):
        for start in (0, 70 - count):
            np.testing.assert_array_equal(
                np.asarray(f(w, jnp.asarray(x[start : start + count]))), alone[start:][:count]
            )


@needs_tiles
def test_rows_past_a_slab_and_inputs_past_a_chunk_are_the_same_bits_in_any_block():
    """600 rows of 1100 inputs (slabs of 512 rows, chunks of 1024 inputs): blocks of them across the slabs' border
    give the rows' bits of the whole."""
    w, _, x = operands(600, 40, 1100, seed=11)
    f = jax.jit(kernels.product)
    whole = np.asarray(f(w, jnp.asarray(x)))
    for start, count in ((0, 1), (500, 30), (511, 2), (512, 88), (90, 510)):
        np.testing.assert_array_equal(np.asarray(f(w, jnp.asarray(x[start : start + count]))), whole[start:][:count])


@needs_tiles
def test_w_as_either_operand_gives_the_same_bits():
    """Slabs of 256 rows or more take W's columns packed as the tiles' B operand, fewer W's rows as the A operand
    where they lie (tiles.h's kPackedRows): every output the same bits either way, so rows computed in few-row calls
    are the rows of a many-row call, for values of every exponent, outputs past the last whole pair and inputs past
    the last whole step (W's rows copied), one term (the bfloat16 tier) or three."""
    rng = np.random.default_rng(13)
    for out, inner in ((70, 577), (96, 640)):
        w = jnp.asarray(rng.standard_normal((out, inner)) * 0.05, jnp.bfloat16)
        spread = widely_spread(300, inner, seed=out)
        rounded = np.asarray(jnp.asarray(spread).astype(jnp.bfloat16).astype(jnp.float32))
        for x, bf16_x in ((spread, False), (rounded, True)):
            f = jax.jit(functools.partial(kernels.product, bf16_x=bf16_x))
            whole = np.asarray(f(w, jnp.asarray(x)))
            for start in range(0, 300, 40):
                np.testing.assert_array_equal(np.asarray(f(w, jnp.asarray(x[start : start + 40]))), whole[start:][:40])


@needs_tiles
def test_the_gradient_through_a_tile_product_is_f32_class():
    """jax.grad through x · Wᵀ on the tiles: with respect to x the transposed product (tiles too), to W gᵀ · x (the
    FMA kernels), both against float64."""
    w, wv, x = operands(9, 64, 96, seed=8)
    g = np.random.default_rng(9).standard_normal((9, 64)).astype(np.float32)
    dw, dx = jax.grad(lambda w, x: jnp.sum(kernels.product(w, x) * g), argnums=(0, 1))(w, jnp.asarray(x))
    for got, exact, (a, b) in (
        (dx, g.astype(np.float64) @ wv, (g, wv)),
        (np.asarray(dw, np.float64), g.T.astype(np.float64) @ x, (g.T, x)),
    ):
        assert relative_error(got, exact) <= 2 * straight_sum_error(a, b, exact) + 2**-8  # dw: rounded to bf16


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_activations_known_to_be_bf16_take_one_term_and_give_the_same_bits(shape):
    """The bfloat16 tier's products (`bf16_x`: its activations rounded to bf16 before them) take one bf16 term on
    the tiles where three would add two terms of zeros: the same bits, in the tiles and elsewhere (where no
    kernel reads it)."""
    w, _, x = operands(*shape, seed=12)
    rounded = jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)
    one = jax.jit(lambda w, x: kernels.product(w, x, bf16_x=True))(w, rounded)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(jax.jit(kernels.product)(w, rounded)))


BLOCK_SHAPES = [(1, 32, 32), (5, 64, 96), (13, 33, 224), (37, 192, 576), (130, 70, 416), (600, 40, 1088)]


def block_operands(held: str, rows: int, out: int, inner: int, seed: int):
    """W [out, inner] of random `held` blocks (finite scales), its values in float64, and x spanning 2^-40..2^40."""
    rng = np.random.default_rng(seed)
    fmt = BY_NAME[held]
    w = fmt(jnp.asarray(finite_blocks(fmt, (out, inner // 32), rng, 0.01)))
    x = rng.standard_normal((rows, inner)) * np.exp2(rng.integers(-40, 40, (rows, 1)))
    return w, np.asarray(dense(w).astype(jnp.float32), np.float64), x.astype(np.float32)


BLOCK_PRODUCTS = {"reference": kernels.tile_product_reference, "tiles": kernels.product}


@pytest.mark.parametrize("held", sorted(kernels.TILE_BLOCKS))
@pytest.mark.parametrize("multiply", ["reference", pytest.param("tiles", marks=needs_tiles)])
@pytest.mark.parametrize("shape", BLOCK_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_blocks_of_32_are_f32_class_against_float64(held, multiply, shape):
    """d · Σ q·x + m · Σ x per block (the tiles' and their reference's): within 2× the error of a straight f32 sum of
    x times the dequantized weights, against float64; the tiles within the class of the reference."""
    w, wv, x = block_operands(held, *shape, seed=shape[0])
    exact = x.astype(np.float64) @ wv.T
    got = jax.jit(BLOCK_PRODUCTS[multiply])(w, jnp.asarray(x))
    straight = straight_sum_error(x, wv.T, exact)
    assert relative_error(got, exact) <= 2 * straight
    if multiply == "tiles":
        reference = np.asarray(kernels.tile_product_reference(w, jnp.asarray(x)), np.float64)
        assert relative_error(got, reference) <= 4 * straight


@needs_tiles
@pytest.mark.parametrize("held", sorted(kernels.TILE_BLOCKS))
def test_a_block_rows_bits_are_the_same_alone_and_among_any_rows(held):
    """Rows alone, in blocks across row tiles and the slab's border (512 rows), one term (bf16 x) or three: the same
    bits as among all 600."""
    w, _, spread = block_operands(held, 600, 70, 1088, seed=3)
    rounded = np.asarray(jnp.asarray(spread).astype(jnp.bfloat16).astype(jnp.float32))
    for x, bf16_x in ((spread, False), (rounded, True)):
        f = jax.jit(functools.partial(kernels.product, bf16_x=bf16_x))
        whole = np.asarray(f(w, jnp.asarray(x)))
        for start, count in ((0, 1), (7, 9), (40, 33), (500, 30), (511, 2), (512, 88), (90, 510)):
            np.testing.assert_array_equal(
                np.asarray(f(w, jnp.asarray(x[start : start + count]))), whole[start:][:count]
            )


@pytest.mark.parametrize("held", sorted(kernels.TILE_BLOCKS))
def test_a_block_product_of_no_inputs_is_zeros(held):
    """W [out, 0] (no blocks): every output is the empty sum, 0 (the tiles' path has no step to write one)."""
    w = BY_NAME[held](jnp.zeros((5, 0, BY_NAME[held].BYTES), jnp.uint8))
    np.testing.assert_array_equal(np.asarray(kernels.product(w, jnp.ones((3, 0), jnp.float32))), np.zeros((3, 5)))
