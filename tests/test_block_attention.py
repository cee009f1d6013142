"""The native block attention (`kernels.attend_block`, attention.cc), which computes only the slots at or before
each query, its softmax online over chunks of slots: it equals float64 attention and XLA's masked path on odd shapes
(T = 1, T not a multiple of the query block, queries at scattered positions of a longer cache, several chunks), a
row's bits do not depend on the rows around it or on how many queries share the block, and gradients through it
are XLA's and float64's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax import kernels
from llama_jax.nn.attention import attention_with_pattern, causal_mask, native_causal_attention

pytestmark = pytest.mark.skipif(not kernels.status().active, reason=str(kernels.status()))


def inputs(b, t, kv, g, h, s, seed, scattered=False):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((b, t, kv * g, h)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((b, kv, s, h)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((b, kv, s, h)), jnp.float32)
    # scattered: as in a cache, each sequence's block at its own length, padding rows included
    positions = np.sort(rng.integers(0, s, (b, t)), axis=1) if scattered else np.broadcast_to(np.arange(t), (b, t))
    return q, k, v, jnp.asarray(positions, jnp.int32)


def float64_attention(q, k, v, positions, window=None, scale=None):
    q, k, v, positions = (np.asarray(a, np.float64 if a.dtype != np.int32 else np.int64) for a in (q, k, v, positions))
    b, t, n, h = q.shape
    g = n // k.shape[1]
    out = np.zeros(q.shape)
    for bi in range(b):
        for ti in range(t):
            for head in range(n):
                end = positions[bi, ti] + 1
                first = 0 if window is None else max(0, end - window)  # a sliding window: the last `window` slots
                keys, values = k[bi, head // g, first:end], v[bi, head // g, first:end]
                scores = keys @ q[bi, ti, head] * (1 / np.sqrt(h) if scale is None else scale)
                weights = np.exp(scores - scores.max())
                out[bi, ti, head] = weights @ values / weights.sum()
    return out


CASES = [
    (1, 1, 1, 1, 64, 1, False),
    (2, 7, 2, 3, 16, 7, False),
    (1, 61, 3, 3, 64, 61, False),
    (2, 5, 1, 2, 8, 40, True),
    (1, 450, 2, 2, 32, 450, False),  # several chunks of 192 slots: the online softmax's rescaling
    (2, 60, 1, 3, 64, 900, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}-t{}-kv{}-g{}-h{}-s{}{}".format(*c[:6], "-cache" * c[6]))
def test_block_attention_equals_float64_and_the_xla_path(case):
    *shape, scattered = case
    q, k, v, positions = inputs(*shape, seed=shape[1], scattered=scattered)
    got = np.asarray(jax.jit(kernels.attend_block)(q, k, v, positions))
    np.testing.assert_allclose(got, float64_attention(q, k, v, positions), rtol=1e-5, atol=2e-6)
    xla = np.asarray(attention_with_pattern(q, k, v, causal_mask(positions, k.shape[2]))[0])
    np.testing.assert_allclose(got, xla, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("window", [1, 5, 16, 100, 300])
@pytest.mark.parametrize("case", [CASES[2], CASES[3], CASES[5]], ids=["prompt", "cache", "long-cache"])
def test_a_sliding_window_equals_float64_and_the_xla_path(case, window):
    """Mistral's window: each query over its last `window` slots (1: itself; 100: all of them), equal to float64
    and to XLA's attention under the windowed causal mask."""
    *shape, scattered = case
    q, k, v, positions = inputs(*shape, seed=shape[1], scattered=scattered)
    got = np.asarray(jax.jit(kernels.attend_block, static_argnums=4)(q, k, v, positions, window))
    np.testing.assert_allclose(got, float64_attention(q, k, v, positions, window), rtol=1e-5, atol=2e-6)
    xla = np.asarray(attention_with_pattern(q, k, v, causal_mask(positions, k.shape[2], window))[0])
    np.testing.assert_allclose(got, xla, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("scale", [2**-6, 0.3])
def test_a_scale_other_than_one_over_sqrt_head_equals_float64_and_the_xla_path(scale):
    """Granite's attention_multiplier: the scores times the scale given, in the block kernel, its gradient and the
    decode kernel (over a cache), each as float64 and XLA's path compute it."""
    q, k, v, positions = inputs(2, 9, 2, 2, 32, 40, seed=4, scattered=True)
    got = np.asarray(jax.jit(kernels.attend_block, static_argnums=(4, 5))(q, k, v, positions, None, scale))
    np.testing.assert_allclose(got, float64_attention(q, k, v, positions, scale=scale), rtol=1e-5, atol=2e-6)
    mask = causal_mask(positions, k.shape[2])
    np.testing.assert_allclose(got, attention_with_pattern(q, k, v, mask, scale=scale)[0], rtol=1e-5, atol=2e-6)

    def loss(attend):
        return lambda q, k, v: jnp.sum(attend(q, k, v) ** 2)

    native = jax.grad(loss(lambda q, k, v: native_causal_attention(q, k, v, positions, None, scale)), (0, 1, 2))
    xla = jax.grad(loss(lambda q, k, v: attention_with_pattern(q, k, v, mask, scale=scale)[0]), (0, 1, 2))
    for a, b in zip(native(q, k, v), xla(q, k, v), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    last = positions[:, -1]  # one query per sequence at its last position, against a cache of one layer
    one = kernels.attend(k[None], v[None], jnp.int32(0), last, q[:, -1], None, scale)
    np.testing.assert_allclose(one, float64_attention(q[:, -1:], k, v, last[:, None], scale=scale)[:, 0], rtol=1e-5,
                               atol=2e-6)  # fmt: skip


def test_a_query_gets_the_same_bits_in_any_block_and_batch():
    """Query t of sequence b: alone in its block (T = t + 1), among all 420, and beside another sequence: the same
    bits (it reads the slots up to its own position, chunk by chunk of 192 slots counted from slot 0, in one order,
    whatever the block's last position)."""
    q, k, v, positions = inputs(2, 420, 3, 3, 64, 420, seed=1)
    f = jax.jit(kernels.attend_block)
    whole = np.asarray(f(q, k, v, positions))
    alone = np.asarray(f(q[1:], k[1:], v[1:], positions[1:]))
    np.testing.assert_array_equal(whole[1], alone[0])
    for t in (0, 11, 12, 47, 48, 99, 191, 192, 383, 419):
        prefix = np.asarray(f(q[:1, : t + 1], k[:1, :, : t + 1], v[:1, :, : t + 1], positions[:1, : t + 1]))
        np.testing.assert_array_equal(prefix[0], whole[0, : t + 1])


@pytest.mark.parametrize(
    ("shape", "scattered", "window"),
    [
        ((2, 13, 2, 3, 16, 17), False, None),
        ((2, 13, 2, 3, 16, 17), True, None),
        ((2, 13, 2, 3, 16, 17), False, 5),
        ((1, 420, 1, 2, 64, 430), True, 100),  # several chunks of slots and blocks of queries
        ((1, 40, 1, 2, 200, 40), False, None),  # a head wider than a chunk of the inner index (192)
    ],
)
def test_gradients_through_block_attention_are_xlas_and_float64s(shape, scattered, window):
    """Its gradient (`kernels.attend_block_grads`: the slots each query reads, the probabilities recomputed) with
    respect to q, k and v equals XLA's autograd through the masked path and, in float64, that path's (within f32
    rounding: 1e-5 of the largest): grouped heads, queries at scattered positions of a longer cache, a sliding
    window."""
    q, k, v, positions = inputs(*shape, seed=2, scattered=scattered)
    mask = causal_mask(positions, shape[-1], window)

    def loss(attend):
        return lambda q, k, v: jnp.sum(jnp.sin(attend(q, k, v)))

    native = jax.grad(loss(lambda q, k, v: native_causal_attention(q, k, v, positions, window)), (0, 1, 2))(q, k, v)
    xla = jax.grad(loss(lambda q, k, v: attention_with_pattern(q, k, v, mask)[0]), (0, 1, 2))(q, k, v)
    with jax.enable_x64():
        wide = [a.astype(jnp.float64) for a in (q, k, v)]
        exact = jax.grad(loss(lambda q, k, v: attention_with_pattern(q, k, v, mask)[0]), (0, 1, 2))(*wide)
    for a, b, c in zip(native, xla, exact, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        scale = np.abs(np.asarray(c)).max()
        assert np.abs(np.asarray(a, np.float64) - np.asarray(c)).max() <= 1e-5 * scale


def test_a_position_outside_the_slots_is_refused():
    q, k, v, positions = inputs(1, 4, 1, 1, 8, 4, seed=3)
    with pytest.raises(Exception, match="outside the key slots"):
        jax.block_until_ready(kernels.attend_block(q, k, v, positions + 1))


def test_the_gradient_kernel_vmapped_equals_it_per_sequence():
    q, k, v, positions = inputs(3, 30, 2, 2, 16, 30, seed=4, scattered=True)
    g = jnp.sin(q)
    out = kernels.attend_block(q, k, v, positions, 7)
    batched = jax.vmap(lambda *a: kernels.attend_block_grads(*a, sliding_window=7))(q, k, v, positions, out, g)
    for b in range(3):
        alone = kernels.attend_block_grads(q[b : b + 1], k[b : b + 1], v[b : b + 1], positions[b : b + 1],
                                           out[b : b + 1], g[b : b + 1], 7)  # fmt: skip
        for x, y in zip(batched, alone, strict=True):
            np.testing.assert_array_equal(np.asarray(x[b]), np.asarray(y[0]))
