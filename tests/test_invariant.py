"""The batch-invariant building blocks (`nn.invariant`) against float64 and against themselves in other arrays: exp
and log within 1.3 ulp of the true value with exact derivatives, an element's bits the same whatever array holds
it, and every row's sum and softmax the same bits in a batch of any size (which XLA's own exp and its products
with a column of ones do not give on an AVX2 CPU)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax.nn import invariant

RNG = np.random.default_rng(0)


def ulps(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """|got - want| in units of the last place of want rounded to f32."""
    return np.abs(got.astype(np.float64) - want) / np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)


def test_exp_is_within_1_3_ulp_of_the_true_value_and_its_derivative_is_itself():
    x = np.concatenate([RNG.uniform(-87, 88.7, 200_000), RNG.uniform(-1, 1, 100_000), RNG.uniform(-30, 0, 100_000)])
    x = x.astype(np.float32)
    assert ulps(np.asarray(jax.jit(invariant.exp)(x)), np.exp(x.astype(np.float64))).max() <= 1.3
    special = np.array([0.0, -0.0, -np.inf, np.inf, -104.0, 88.8, -110.0], np.float32)
    np.testing.assert_array_equal(invariant.exp(jnp.asarray(special)), [1, 1, 0, np.inf, 0, np.inf, 0])
    grad = jax.vmap(jax.grad(invariant.exp))(x[:1000])
    np.testing.assert_array_equal(grad, invariant.exp(jnp.asarray(x[:1000])))


def test_log_is_within_1_3_ulp_of_the_true_value_and_its_derivative_is_the_reciprocal():
    x = np.concatenate(
        [RNG.uniform(1, 60_000, 200_000), RNG.uniform(0.5, 2, 100_000), np.exp(RNG.uniform(-80, 80, 100_000))]
    )
    x = x.astype(np.float32)
    assert ulps(np.asarray(jax.jit(invariant.log)(x)), np.log(x.astype(np.float64))).max() <= 1.3
    assert float(invariant.log(jnp.float32(1.0))) == 0.0
    np.testing.assert_array_equal(jax.vmap(jax.grad(invariant.log))(x[:1000]), np.float32(1.0) / x[:1000])


@pytest.mark.parametrize("fn", [invariant.exp, invariant.log], ids=["exp", "log"])
def test_an_element_gets_the_same_bits_in_an_array_of_any_size(fn):
    x = RNG.uniform(0.01, 80, 4096).astype(np.float32)
    x = -x if fn is invariant.exp else x
    f = jax.jit(fn)
    whole = np.asarray(f(x))
    for n in [*range(1, 34), 63, 64, 65, 127, 128, 129, 199]:  # every tail of a vector loop, and longer ones
        np.testing.assert_array_equal(np.asarray(f(x[:n])), whole[:n], f"size {n}")


@pytest.mark.parametrize("t", [1, 3, 5, 8, 16, 21, 64, 100])
def test_each_row_s_sum_and_softmax_are_the_same_bits_in_a_batch_of_any_size(t):
    """Rows of a [B, 9, T, S] block of scores (attention's shape), B = 1..8: the same bits as alone; the sum within
    the pairwise tree's error bound of float64's."""
    x = RNG.standard_normal((8, 9, t, t + 3)).astype(np.float32)
    sums, softmax, log_softmax = (jax.jit(f) for f in (invariant.sum_last, invariant.softmax_last,
                                                         invariant.log_softmax_last))  # fmt: skip
    for f in (sums, softmax, log_softmax):
        alone = np.asarray(f(x[:1]))[0]
        for b in range(2, 9):
            np.testing.assert_array_equal(np.asarray(f(x[:b]))[0], alone, f"{f} batch {b}")
    exact = x.astype(np.float64).sum(-1, keepdims=True)
    bound = np.ceil(np.log2(t + 3)) * np.finfo(np.float32).eps * np.abs(x.astype(np.float64)).sum(-1, keepdims=True)
    assert (np.abs(np.asarray(sums(x)) - exact) <= bound).all()


@pytest.mark.parametrize("s", [576, 1536, 2048, 49152])
def test_the_tree_sum_is_f32_class_against_float64(s):
    """The f32-class rule: over 64 rows of softmax-like (positive) and residual-like (signed) numbers, the tree's
    largest relative error against float64 is at most twice that of a straight f32 sum (left to right)."""
    for x in (RNG.exponential(1.0, (64, s)), RNG.standard_normal((64, s))):
        x = x.astype(np.float32)
        exact = x.astype(np.float64).sum(-1)
        scale = np.abs(x.astype(np.float64)).sum(-1)
        tree = np.asarray(jax.jit(invariant.sum_last)(jnp.asarray(x)))[:, 0].astype(np.float64)
        straight = np.cumsum(x, axis=-1, dtype=np.float32)[:, -1].astype(np.float64)
        assert (np.abs(tree - exact) / scale).max() <= 2 * (np.abs(straight - exact) / scale).max()


@pytest.mark.parametrize("h", [8, 24, 32, 48, 64, 96, 100, 128, 160])
def test_xla_attention_gives_a_query_the_same_bits_in_a_block_of_any_length_and_batch(h):
    """XLA's attention (`attention_with_pattern`, the path without the native kernels) at head sizes from 8 to 160
    (Phi-3's 96, OpenLLaMA's 100, Qwen3-scaled 32): a query's output is the same bits in a block of 1 to 200 of its
    sequence's positions and beside another sequence (XLA CPU sums a head of 24-160 numbers in an order that depends
    on the number of rows, but for the zero padding to 64 the attention adds)."""
    from llama_jax.nn.attention import attention_with_pattern, causal_mask

    b, t, n, kv, s = 2, 200, 6, 2, 260
    q = jnp.asarray(RNG.standard_normal((b, t, n, h)), jnp.float32)
    k, v = (jnp.asarray(RNG.standard_normal((b, kv, s, h)), jnp.float32) for _ in range(2))
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    attend = jax.jit(lambda q, k, v, positions: attention_with_pattern(q, k, v, causal_mask(positions, s))[0])
    whole = np.asarray(attend(q, k, v, positions))
    for rows in (1, 2, 13, 16, 100):
        part = attend(q[:1, :rows], k[:1], v[:1], positions[:1, :rows])
        np.testing.assert_array_equal(part[0], whole[0, :rows], f"{rows} positions")
