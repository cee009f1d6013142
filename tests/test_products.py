"""The native block product (`kernels.product`, products.cc): x · Wᵀ and its transpose for any number of rows, on
every kind a matrix is held in. Its laws: f32 class against float64 (at most 2× the error of a straight f32 sum,
on odd shapes and the 1.7B model's), every row the same bits whatever the rows around it, the same numbers as XLA's
product, and gradients (through jax.grad and vmap) equal to XLA's."""

from __future__ import annotations

import re

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from llama_jax import kernels
from llama_jax.core.quantized import BY_NAME, FORMATS, Q4_1, dense
from llama_jax.errors import NativeKernelError
from llama_jax.loaders.tensors import weights_from_tensors
from llama_jax.nn.linear import linear
from llama_jax.passes.forward import forward
from llama_jax.testing import random_tensors, random_weights, tiny_config
from tests.gguf_builder import finite_blocks
from tests.helpers import relative_error, straight_sum_error

pytestmark = pytest.mark.skipif(not kernels.status().active, reason=str(kernels.status()))

KINDS = ("float32", "bfloat16", "float16", *(f.__name__ for f in FORMATS.values()))


def matrix(held: str, rows: int, cols: int, seed: int):
    """A [rows, cols] weight held as `held`: floats, or blocks with random quants and finite scales."""
    rng = np.random.default_rng(seed)
    if held in ("float32", "bfloat16", "float16"):
        return jnp.asarray(rng.standard_normal((rows, cols)) * 0.05, held)
    fmt = BY_NAME[held]
    return fmt(jnp.asarray(finite_blocks(fmt, (rows, cols // fmt.VALUES), rng, 0.01)))


def whole_blocks(held: str, cols: int) -> int:
    """cols rounded up to whole blocks of the held kind (the k-quants' 256 values)."""
    step = BY_NAME[held].VALUES if held in BY_NAME else 1
    return -(-cols // step) * step


def values(w) -> np.ndarray:
    return np.asarray(dense(w).astype(jnp.float32), np.float64)


def transposed(w, g):
    """g · W: the product's gradient with respect to x (its VJP, the transposed product by the kernel)."""
    x = jnp.zeros((*g.shape[:-1], w.shape[-1]), jnp.float32)
    return jax.vjp(lambda x: kernels.product(w, x), x)[1](g)[0]


SHAPES = [(1, 32, 32), (5, 64, 96), (13, 33, 224), (37, 192, 576), (130, 70, 416)]  # rows, out, in: odd tiles


@pytest.mark.parametrize("held", KINDS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_the_product_and_its_transpose_are_f32_class_against_float64(held, shape):
    """Within 2× the error of a straight f32 sum, against the float64 product of the same values."""
    rows, out, inner = shape
    inner = whole_blocks(held, inner)
    w = matrix(held, out, inner, seed=rows)
    wv = values(w)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    g = rng.standard_normal((rows, out)).astype(np.float32)
    for got, a, b in (
        (jax.jit(kernels.product)(w, jnp.asarray(x)), x, wv.T),
        (jax.jit(transposed)(w, jnp.asarray(g)), g, wv),
    ):
        exact = a.astype(np.float64) @ b
        error, straight = relative_error(got, exact), straight_sum_error(a, b, exact)
        assert error <= 2 * straight, (error, straight)


@pytest.mark.slow
@pytest.mark.parametrize("held", ["float32", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("shape", [(7, 2048, 2048), (7, 8192, 2048), (7, 2048, 8192)], ids=["qo", "gate-up", "down"])
def test_the_1_7b_model_shapes_are_f32_class(held, shape):
    rows, out, inner = shape
    w = matrix(held, out, inner, seed=out)
    x = np.random.default_rng(2).standard_normal((rows, inner)).astype(np.float32)
    exact = x.astype(np.float64) @ values(w).T
    error, straight = (
        relative_error(kernels.product(w, jnp.asarray(x)), exact),
        straight_sum_error(x, values(w).T, exact),
    )
    assert error <= 2 * straight, (error, straight)


@pytest.mark.parametrize("held", ["float32", "bfloat16", "Q4_1", "Q4_0", "Q6_K"])
def test_a_row_is_the_same_bits_alone_and_among_any_rows(held):
    """Rows 0..39 alone, and in blocks of every size at the start and at the end: the same bits, for the product
    and its transpose (row tiles of 12 and 6, column panels, threads: none changes a row's order)."""
    inner = whole_blocks(held, 160)
    w = matrix(held, 96, inner, seed=5)
    rng = np.random.default_rng(6)
    xs = jnp.asarray(rng.standard_normal((40, inner)), jnp.float32)
    gs = jnp.asarray(rng.standard_normal((40, 96)), jnp.float32)
    for f, data in ((jax.jit(kernels.product), xs), (jax.jit(transposed), gs)):
        alone = np.concatenate([np.asarray(f(w, data[r : r + 1])) for r in range(40)])
        for count in (2, 7, 12, 13, 25, 40):
            for start in (0, 40 - count):
                np.testing.assert_array_equal(np.asarray(f(w, data[start : start + count])), alone[start:][:count])


@pytest.mark.parametrize("held", ["float32", "Q8_0", "Q4_K"])
def test_gradients_through_the_product_equal_xlas(held):
    """jax.grad of a loss of x · Wᵀ: with respect to x (the transposed product, native) and, for float weights,
    to W (gᵀ · x, native), the same as through XLA's product to f32 rounding; and under vmap."""
    inner = whole_blocks(held, 96)
    w = matrix(held, 64, inner, seed=8)
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.standard_normal((3, 11, inner)), jnp.float32)

    def loss(product):
        return lambda w, x: jnp.sum(jnp.sin(product(w, x)))

    def native(w, x):
        return kernels.product(w, x)

    def xla(w, x):
        return linear(x, dense(w))

    argnums = (0, 1) if held == "float32" else (1,)
    got = jax.jit(jax.grad(loss(native), argnums))(w, x)
    expected = jax.jit(jax.grad(loss(xla), argnums))(w, x)
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    per_example = jax.vmap(jax.grad(loss(native), 1), in_axes=(None, 0))(w, x)
    np.testing.assert_allclose(np.asarray(per_example), np.asarray(expected[-1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, o, i", [(1, 3, 5), (37, 50, 70), (300, 192, 576), (1024, 40, 33)])
def test_the_weight_gradient_is_f32_class_and_per_example_under_vmap(rows, o, i):
    """The gradient of x · Wᵀ with respect to float weights, gᵀ · x summed over every row (products.cc's
    WeightGrad): within 2× a straight f32 sum's error against float64 (odd sizes, rows past one chunk, rows 4 KB
    apart); vmapped over examples, each example's own gradient, bit for bit."""
    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.standard_normal((o, i)) * 0.1, jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, rows, i)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((2, rows, o)), jnp.float32)

    def weight_grad(x, g):  # [R, I], [R, O] -> [O, I]
        return jax.vjp(lambda w: kernels.product(w, x), w)[1](g)[0]

    got = np.asarray(jax.jit(weight_grad)(x[0], g[0]), np.float64)
    exact = np.asarray(g[0], np.float64).T @ np.asarray(x[0], np.float64)
    error, straight = relative_error(got, exact), straight_sum_error(np.asarray(g[0]).T, np.asarray(x[0]), exact)
    assert error <= 2 * straight, (error, straight)
    per_example = jax.jit(jax.vmap(weight_grad))(x, g)
    for e in range(2):
        np.testing.assert_array_equal(np.asarray(per_example[e]), np.asarray(jax.jit(weight_grad)(x[e], g[e])))


@pytest.mark.parametrize("held", ["float32", "bfloat16"])
def test_a_float_layer_read_in_place_is_its_slice_and_copies_nothing(held):
    """In a layer scan, the product read from the stacked float weights at the layer (`piece`: the scan's own
    slice, which takes the weight gradient) gives the slice's product, its gradients with respect to every layer's
    weights and to x, bit for bit; the compiled gradient holds no copy of a layer's weights (a dynamic slice of
    the stack, which the slice's product makes); a stack read at a layer without its slice, or with a slice of
    another shape or dtype, is refused."""
    layers, o, i = 3, 96, 64
    stack = jnp.asarray(np.random.default_rng(4).standard_normal((layers, o, i)) * 0.1, held)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((2, 9, i)), jnp.float32)

    def loss(in_place):
        def total(weights, x):
            def layer(x, xs):  # [2, 9, I] -> [2, 9, I]
                w, index = xs
                y = kernels.product(weights, x, index, piece=w) if in_place else kernels.product(w, x)
                return jnp.tanh(y[..., :i]), None

            return jnp.sum(lax.scan(layer, x, (weights, jnp.arange(layers)))[0] ** 2)

        return total

    grads = {f: jax.jit(jax.value_and_grad(loss(f), (0, 1)))(stack, x) for f in (False, True)}
    for a, b in zip(jax.tree.leaves(grads[False]), jax.tree.leaves(grads[True]), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    copy = re.compile(rf"dynamic-slice\S* = \w+\[(1,)?{o},{i}\]")  # a layer's weights sliced out of the stack
    compiled = {f: jax.jit(jax.grad(loss(f))).lower(stack, x).compile().as_text() for f in (False, True)}
    assert copy.search(compiled[False]) and not copy.search(compiled[True])
    with pytest.raises(NativeKernelError, match=r"needs piece=w\[layer\]"):
        kernels.product(stack, x, jnp.int32(0))
    with pytest.raises(NativeKernelError, match="is not layer"):
        kernels.product(stack, x, jnp.int32(0), piece=stack[0].astype(jnp.float16))


def stored_q4_1(config):
    """A tiny model whose matrices are held as Q4_1 blocks (the norms in f32)."""
    tensors = {}
    for name, a in random_tensors(config, seed=3).items():
        if a.ndim == 2:
            raw = gguf.quants.quantize(a.astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
            a = Q4_1(raw.reshape(a.shape[0], a.shape[1] // 32, Q4_1.BYTES))
        tensors[name] = a
    return weights_from_tensors(config, {n: (lambda a=a: a) for n, a in tensors.items()}, "random", "stored")


@pytest.mark.parametrize("held", ["float32", "Q4_1"])
def test_a_native_forward_equals_the_xla_one(held):
    """Every activation and the logits of a tiny model, native against XLA's products: within 1e-5 of each
    array's largest value (a tiny random model's activations reach tens)."""
    config = tiny_config(kv=2, g=2, half=16, ffn=96, layers=2)
    weights = random_weights(config, seed=3) if held == "float32" else stored_q4_1(config)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab, (2, 19)), jnp.int32)
    run = jax.jit(forward, static_argnames=("config", "keep", "native"))
    (a, acts_a), (b, acts_b) = (run(weights, tokens, config, keep=True, native=n) for n in (False, True))
    for x, y in zip([a, *jax.tree.leaves(acts_a)], [b, *jax.tree.leaves(acts_b)], strict=True):
        x, y = np.asarray(x), np.asarray(y)
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-5 * np.abs(x).max())


@pytest.mark.slow
def test_the_default_models_own_products_are_f32_class():
    """The stored default's q, o, gate and down matrices of layers 0, 15 and 29 against each layer's own inputs
    (n1, attn, n2, hidden) for a sentence: within 2× a straight f32 sum's error against float64."""
    import llama_jax

    model = llama_jax.load()
    ids = model.tokenizer.encode("The history of the Roman Empire spans many centuries, beginning with Rome.")
    acts = model.activations(ids, keep=("n1", "n2", "hidden", "attn"))
    for layer in (0, 15, 29):
        for name, site in (("q", "n1"), ("o", "attn"), ("gate", "n2"), ("down", "hidden")):
            w = jax.tree.map(lambda a, i=layer: a[i], getattr(model.weights.layers, name))
            x, wv = np.asarray(acts[site][layer], np.float32), values(w)
            exact = x.astype(np.float64) @ wv.T
            error, straight = (
                relative_error(kernels.product(w, jnp.asarray(x)), exact),
                straight_sum_error(x, wv.T, exact),
            )
            assert error <= 2 * straight, (layer, name, error, straight)
