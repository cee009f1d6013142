"""The kernels' speed parameters (`kernels.tuning`) choose how fast a result comes, never its bits: a matrix-vector
product gives the same bits under this machine's choice and under sets at the parameters' extremes, for every
kind a matrix is held in and every batch (each tile shape, one or two passes, the inputs in one segment or
several, any number of pieces a thread); a block product and its transpose the same bits with their columns in
narrow or wide items."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax import kernels
from llama_jax.core.quantized import FORMATS
from llama_jax.errors import NativeKernelError
from llama_jax.kernels.tuning import MatvecTuning, ProductTuning, choose, chosen
from tests.gguf_builder import finite_blocks

native_only = pytest.mark.skipif(not kernels.status().active, reason=str(kernels.status()))

SETS = {
    "chosen": chosen().matvec,
    "never split, one piece a thread, nothing ahead": MatvecTuning(split_bytes=1 << 40, ahead_small=0, ahead_large=0,
                                                                   items_per_thread=1),
    "always split, many pieces, far ahead": MatvecTuning(split_bytes=0, ahead_small=1 << 16, ahead_large=1 << 20,
                                                         items_per_thread=64),
    "split into uneven segments": MatvecTuning(split_bytes=11000),  # 1536 inputs at batch 8: 4 x 320 inputs, then 256
}  # fmt: skip


def products(w, x) -> dict[str, np.ndarray]:
    """x · w[1]ᵀ under each set of SETS."""
    return {
        name: np.asarray(jax.jit(functools.partial(kernels.matvec, tuning=t))(w, jnp.int32(1), x))
        for name, t in SETS.items()
    }


@native_only
@pytest.mark.parametrize("held", ["float32", "bfloat16", *(t.name for t in FORMATS)])
def test_every_parameter_set_gives_the_same_bits(held):
    """Rows of 1536 inputs (x of 5-8 sequences 30-48 KB: either side of an L1's size) and 512, batches 1-8 and 11;
    99 rows (tiles of 4, 2 and 1 row all run); the k-quants' limb kernel as well as the widening one."""
    rng = np.random.default_rng(3)
    blocks = {t.name: fmt for t, fmt in FORMATS.items()}
    for inputs in (1536, 512):
        if held in blocks:
            fmt = blocks[held]
            w = fmt(jnp.asarray(finite_blocks(fmt, (3, 99, inputs // fmt.VALUES), rng, 0.05)))
        else:
            w = jnp.asarray(rng.standard_normal((3, 99, inputs)), jnp.dtype(held))
        for batch in (1, 2, 4, 5, 6, 8, 11):
            x = jnp.asarray(rng.standard_normal((batch, inputs)), jnp.float32)
            ys = products(w, x)
            for name, y in ys.items():
                np.testing.assert_array_equal(y, ys["chosen"], err_msg=f"{name}, {inputs} inputs, batch {batch}")


@native_only
@pytest.mark.parametrize("held", ["float32", "Q4_1", "Q6_K"])
def test_a_block_product_gives_the_same_bits_in_narrow_and_wide_items(held):
    """x · Wᵀ and its transpose (the gradient's) over 300 rows, W 1024 x 512 (the transpose's x rows 4 KB apart,
    copied in wide items): items of a few panels (x never "large") and of as many as keep each thread busy (x
    always "large"), beside this machine's choice."""
    rng = np.random.default_rng(4)
    blocks = {t.name: fmt for t, fmt in FORMATS.items()}
    if held in blocks:
        fmt = blocks[held]
        w = fmt(jnp.asarray(finite_blocks(fmt, (1024, 512 // fmt.VALUES), rng, 0.05)))
    else:
        w = jnp.asarray(rng.standard_normal((1024, 512)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((300, 512)), jnp.float32)
    sets = {"chosen": None, "narrow": ProductTuning(large_x_bytes=1 << 40), "wide": ProductTuning(large_x_bytes=0)}
    for name, t in sets.items():
        y, back = jax.jit(lambda x, t=t: jax.vjp(lambda x: kernels.product(w, x, tuning=t), x))(x)
        g = back(y)[0]
        if name == "chosen":
            y0, g0 = np.asarray(y), np.asarray(g)
        np.testing.assert_array_equal(np.asarray(y), y0, err_msg=name)
        np.testing.assert_array_equal(np.asarray(g), g0, err_msg=name)


@native_only
def test_a_set_the_kernel_cannot_run_is_refused():
    w = jnp.ones((2, 8, 32), jnp.float32)
    bad = MatvecTuning(split_bytes=0, items_per_thread=0)
    with pytest.raises(NativeKernelError, match="items_per_thread"):
        jax.jit(functools.partial(kernels.matvec, tuning=bad))(w, jnp.int32(0), jnp.ones((1, 32))).block_until_ready()


def test_the_choice_follows_the_l1_data_cache_and_says_why():
    assert choose(49152).matvec.split_bytes == 49152 and "48 KB" in choose(49152).reason
    assert choose(32768, 512 << 10).product.large_x_bytes == 8 << 20 and "512 KB" in choose(32768, 512 << 10).reason
    unknown = choose(None)
    assert unknown.matvec.split_bytes == 32768 and "unknown" in unknown.reason
    assert unknown.product.large_x_bytes == 16 << 20
    assert str(chosen()).startswith("matvec split_bytes")
