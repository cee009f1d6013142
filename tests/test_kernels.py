"""The native decode kernels compute what the XLA paths compute: the matrix-vector product (f32 and bf16
weights, read in place from the stacked layers), attention over the cache, and a whole decode loop."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax import KVCache, kernels, prefill
from llama_jax.core.quantized import FORMATS
from llama_jax.errors import NativeKernelError
from llama_jax.kernels import library
from llama_jax.kernels.variants import VARIANTS
from llama_jax.nn.attention import causal_mask
from llama_jax.nn.head import embed
from llama_jax.passes import cached
from llama_jax.passes.decode_batch import RowSettings, decode_chunk
from llama_jax.testing import attention, random_weights, tiny_config
from tests.gguf_builder import finite_blocks

# skipped where the kernels cannot run, unless LLAMA_JAX_NATIVE=require (as in CI), which fails instead
pytestmark = pytest.mark.skipif(not kernels.status().active, reason=str(kernels.status()))


@pytest.mark.parametrize("batch", [1, 3, 8, 11])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matvec_reads_the_chosen_layer_and_equals_float64(batch, dtype):
    rng = np.random.default_rng(batch)
    w = jnp.asarray(rng.standard_normal((4, 200, 77)), dtype)  # odd sizes: the vector tails are exercised
    x = jnp.asarray(rng.standard_normal((batch, 77)), jnp.float32)
    y = np.asarray(jax.jit(kernels.matvec)(w, jnp.int32(2), x))
    expected = np.asarray(x, np.float64) @ np.asarray(w[2].astype(jnp.float32), np.float64).T
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 1, 4, 31, 300])
def test_attend_equals_attention_over_the_written_slots(window):
    """One query per sequence, sequences at different positions (one piece of slots, and three: the kernel joins
    its pieces' softmaxes), grouped heads (K 2, G 3); with a sliding window, over the last `window` written slots
    only (from the middle of a piece)."""
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((3, 2, 2, 600, 8)) * 2, jnp.float32)  # [L, B, K, S, H]
    v = jnp.asarray(rng.standard_normal((3, 2, 2, 600, 8)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((2, 6, 8)), jnp.float32)  # [B, N, H]
    last = jnp.array([5, 590], jnp.int32)
    out = np.asarray(jax.jit(kernels.attend, static_argnums=5)(k, v, jnp.int32(1), last, q, window))
    mask = causal_mask(last[:, None], 600, window)  # [B, 1, S]
    expected = np.asarray(attention(q[:, None], k[1], v[1], mask))[:, 0]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("head", [20, 72, 128])
def test_attend_equals_float64_at_any_head_size(head):
    """Head sizes the kernel's fast paths cut differently (scores 4 slots at a time where H is a multiple of 8, values
    64 at a time in registers, then a tail of 8; 20: neither): within f32 rounding of the float64 attention, pieces
    of 256 slots whose counts are not multiples of 4 included."""
    rng = np.random.default_rng(head)
    k = rng.standard_normal((1, 2, 2, 600, head)) * 2  # [L, B, K, S, H]
    v = rng.standard_normal((1, 2, 2, 600, head))
    q = rng.standard_normal((2, 4, head))  # [B, N, H]
    last = np.array([6, 590])
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    out = np.asarray(kernels.attend(f32(k), f32(v), jnp.int32(0), jnp.asarray(last, jnp.int32), f32(q)))
    k, v, q = (np.asarray(f32(a), np.float64) for a in (k, v, q))  # the kernel's inputs, exactly
    for b in range(2):
        for n in range(4):
            scores = k[0, b, n // 2, : last[b] + 1] @ q[b, n] / np.sqrt(head)
            p = np.exp(scores - scores.max())
            expected = p @ v[0, b, n // 2, : last[b] + 1] / p.sum()
            np.testing.assert_allclose(out[b, n], expected, rtol=1e-5, atol=2e-6, err_msg=f"sequence {b}, head {n}")


def test_attend_gives_a_sequence_the_same_bits_alone_and_in_a_batch():
    """Deep sequences (pieces of slots on every thread) beside shallow ones: each sequence's output is the bits it
    gets alone."""
    rng = np.random.default_rng(1)
    k = jnp.asarray(rng.standard_normal((2, 4, 3, 1100, 64)), jnp.float32)  # [L, B, K, S, H]
    v = jnp.asarray(rng.standard_normal((2, 4, 3, 1100, 64)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((4, 9, 64)), jnp.float32)  # [B, N, H]
    last = jnp.array([1099, 3, 700, 256], jnp.int32)
    attend = jax.jit(kernels.attend)
    together = np.asarray(attend(k, v, jnp.int32(1), last, q))
    for b in range(4):
        alone = np.asarray(attend(k[:, b : b + 1], v[:, b : b + 1], jnp.int32(1), last[b : b + 1], q[b : b + 1]))
        np.testing.assert_array_equal(together[b], alone[0], f"sequence {b}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_native_decode_loop_equals_the_xla_one(dtype):
    """Twelve greedy steps of two sequences: the same tokens, and the final logits within 1e-4."""
    config = tiny_config(kv=2, g=2, half=8, ffn=48, layers=3)
    weights = random_weights(config, seed=4, dtype=dtype)
    block = np.array([[5, 17, 200, 3], [8, 1, 77, 0]], np.int32)
    settings = RowSettings(jnp.zeros(2), jnp.zeros(2, jnp.int32), jnp.ones(2), jnp.zeros(2, jnp.uint32))
    results = []
    for native in (False, True):
        logits, cache = prefill(weights, KVCache.empty(config, 2, 64), block, config, n=[4, 3], native=native)
        out, logits, _, _ = decode_chunk(
            weights,
            cache,
            logits,
            settings,
            jnp.zeros(2, jnp.int32),
            config=config,
            steps=12,
            width=1,
            greedy=True,
            native=native,
            window=64,
        )
        results.append((np.asarray(out), np.asarray(logits)))
    np.testing.assert_array_equal(results[0][0], results[1][0])
    np.testing.assert_allclose(results[0][1], results[1][1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matvec_sums_each_output_in_one_order_whatever_the_batch(dtype):
    """Row b of a batch of 1 to 16 (any place, any neighbours) equals the same row alone, bit for bit."""
    rng = np.random.default_rng(7)
    w = jnp.asarray(rng.standard_normal((2, 301, 203)), dtype)
    xs = jnp.asarray(rng.standard_normal((16, 203)), jnp.float32)
    f = jax.jit(kernels.matvec)
    alone = np.stack([np.asarray(f(w, jnp.int32(1), xs[b : b + 1]))[0] for b in range(16)])
    for batch in range(1, 17):
        for start in (0, 16 - batch):
            together = np.asarray(f(w, jnp.int32(1), xs[start : start + batch]))
            np.testing.assert_array_equal(together, alone[start : start + batch])


@pytest.mark.parametrize("batch", [1, 8, 11])
@pytest.mark.parametrize("fmt", [None, *FORMATS.values()], ids=lambda f: "F32" if f is None else f.__name__)
def test_matvecs_gives_each_matrix_the_bits_of_its_own_matvec(fmt, batch):
    """One call over several matrices of a layer (as q, k and v: different heights, one of a single row) equals a
    call each, bit for bit, and float64's product within f32 rounding; matrices of two kinds are refused."""
    rng = np.random.default_rng(batch)
    inputs = 512

    def matrix(rows):
        if fmt is None:
            return jnp.asarray(rng.standard_normal((3, rows, inputs)), jnp.float32)
        return fmt(jnp.asarray(finite_blocks(fmt, (3, rows, inputs // fmt.VALUES), rng, 0.05)))

    ws = [matrix(rows) for rows in (96, 33, 1)]
    x = jnp.asarray(rng.standard_normal((batch, inputs)), jnp.float32)
    together = jax.jit(kernels.matvecs)(ws, jnp.int32(2), x)
    for w, y in zip(ws, together, strict=True):
        np.testing.assert_array_equal(y, jax.jit(kernels.matvec)(w, jnp.int32(2), x))
        values = np.asarray(w.dequantize() if fmt is not None else w, np.float64)[2]  # [O, I]
        bound = np.abs(np.asarray(x, np.float64)) @ np.abs(values).T  # f32 rounding of the sum, at most
        assert (np.abs(np.asarray(y) - np.asarray(x, np.float64) @ values.T) <= inputs * 2**-23 * bound).all()
    with pytest.raises(NativeKernelError, match="one kind"):
        kernels.matvecs([ws[0], jnp.zeros((3, 4, inputs), jnp.bfloat16)], jnp.int32(0), x)


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=lambda f: f.__name__)
def test_block_matvec_of_wide_rows_sums_in_one_order_whatever_the_batch(fmt):
    """Rows of 2592 inputs (2560 for the k-quants' blocks of 256; where 5-8 sequences' x outgrows L1 and the AVX-512
    kernel takes its two-pass tiles): row b of a batch of 1 to 16 equals the same row alone, bit for bit, and is
    within f32 error of float64."""
    rng = np.random.default_rng(11)
    n = 2592 // fmt.VALUES  # blocks per row
    w = fmt(jnp.asarray(finite_blocks(fmt, (1, 37, n), rng, 0.05)))
    xs = jnp.asarray(rng.standard_normal((16, n * fmt.VALUES)), jnp.float32)
    f = jax.jit(kernels.matvec)
    alone = np.stack([np.asarray(f(w, jnp.int32(0), xs[b : b + 1]))[0] for b in range(16)])
    for batch in range(1, 17):
        together = np.asarray(f(w, jnp.int32(0), xs[16 - batch :]))
        np.testing.assert_array_equal(together, alone[16 - batch :])
    exact = np.asarray(xs, np.float64) @ np.asarray(w.dequantize()[0], np.float64).T
    bound = np.abs(np.asarray(xs, np.float64)) @ np.abs(np.asarray(w.dequantize()[0], np.float64)).T
    assert (np.abs(alone - exact) <= n * fmt.VALUES * np.finfo(np.float32).eps * bound).all()


CROSS_VARIANT = """
import sys
import jax, jax.numpy as jnp, numpy as np
from llama_jax import kernels
from llama_jax.core.quantized import FORMATS, Q4_1
from tests.gguf_builder import finite_blocks
assert kernels.status("require").variant == sys.argv[1], kernels.status()
rng = np.random.default_rng(3)
x = jnp.asarray(rng.standard_normal((9, 104)), jnp.float32)  # 104 = 6 x 16 + a tail of 8
out = {}
for dtype in ("float32", "bfloat16", "float16"):
    w = jnp.asarray(rng.standard_normal((2, 70, 104)), dtype)
    out[dtype] = np.asarray(kernels.matvec(w, jnp.int32(1), x))
for fmt in FORMATS.values():  # rows of 3 blocks
    x = jnp.asarray(rng.standard_normal((9, 3 * fmt.VALUES)), jnp.float32)
    blocks = finite_blocks(fmt, (2, 70, 3), rng, 0.05)
    out[fmt.__name__] = np.asarray(kernels.matvec(fmt(jnp.asarray(blocks)), jnp.int32(1), x))
    w = fmt(jnp.asarray(blocks[1]))  # the block products: 37 rows (not a multiple of either row tile), 70 columns
    xs = jnp.asarray(rng.standard_normal((37, 3 * fmt.VALUES)), jnp.float32)
    out[f"product {fmt.__name__}"] = np.asarray(kernels.product(w, xs))
    vjp = jax.vjp(lambda x: kernels.product(w, x), xs)[1]  # the transposed product
    out[f"transposed {fmt.__name__}"] = np.asarray(vjp(xs[:, :70])[0])
blocks = rng.integers(0, 256, (1, 37, 81, 20), dtype=np.uint8)  # Q4_1 rows of 2592: the two-pass tiles at 5-8
blocks[..., :4] = rng.uniform(-0.05, 0.05, (1, 37, 81, 2)).astype(np.float16).view(np.uint8)
wide = jnp.asarray(rng.standard_normal((9, 2592)), jnp.float32)
out["wide Q4_1"] = np.asarray(kernels.matvec(Q4_1(jnp.asarray(blocks)), jnp.int32(0), wide))
w = jnp.asarray(rng.standard_normal((70, 104)), jnp.float32)
xs = jnp.asarray(rng.standard_normal((37, 104)), jnp.float32)
out["product float32"] = np.asarray(kernels.product(w, xs))
out["weight gradient"] = np.asarray(jax.vjp(lambda w: kernels.product(w, xs), w)[1](xs[:, :70])[0])
q = jnp.asarray(rng.standard_normal((2, 253, 6, 64)), jnp.float32)  # two chunks of slots
k, v = (jnp.asarray(rng.standard_normal((2, 2, 253, 64)), jnp.float32) for _ in range(2))
out["attend_block"] = np.asarray(kernels.attend_block(q, k, v, jnp.broadcast_to(jnp.arange(253), (2, 253))))
cache = [jnp.asarray(rng.standard_normal((1, 2, 2, 700, 64)), jnp.float32) for _ in range(2)]  # three pieces
out["attend"] = np.asarray(kernels.attend(*cache, jnp.int32(0), jnp.array([699, 40], jnp.int32), q[:, 0]))
np.savez(sys.argv[2], **out)
"""


@pytest.mark.skipif(kernels.status().variant not in ("amx", "avx512"), reason="the machine runs one variant only")
def test_every_variant_gives_the_same_bits(tmp_path):
    """The AMX, AVX-512 and AVX2 libraries sum in one order (matvec.cc, gemm.h, attention.cc): the same products,
    bit for bit, for every type the weights are held in, at batch 9 (a full pass of 8 and one more), the scalar tail
    included; the same block products (but x · Wᵀ of bf16 weights and of Q4_0, Q4_1 and Q8_0 blocks on AMX tiles:
    tests/test_tiles.py), their transposes and a float weight's gradient, and the same block and decode attention
    (their exp included)."""
    results = {}
    for variant in ("amx", "avx512", "avx2")[kernels.status().variant != "amx" :]:
        env = {**os.environ, "LLAMA_JAX_NATIVE_VARIANT": variant}
        path = tmp_path / f"{variant}.npz"
        done = subprocess.run(
            [sys.executable, "-c", CROSS_VARIANT, variant, str(path)], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr[-3000:]
        results[variant] = dict(np.load(path))
    on_tiles = {f"product {held}" for held in kernels.TILE_BLOCKS}  # the tiles' x · Wᵀ: tests/test_tiles.py
    for variant, other in results.items():
        assert other.keys() == results["avx512"].keys()
        for name, value in results["avx512"].items():
            if variant != "amx" or name not in on_tiles:
                np.testing.assert_array_equal(value, other[name], err_msg=f"{variant}: {name}")


def test_a_native_decode_step_gathers_bf16_embeddings_without_widening_the_table():
    """The embedding lookup of a bf16 table reads the tokens' rows only: the compiled step (the head on the native
    kernel) holds no f32 copy of the [vocab, dim] table (XLA's CPU backend widens a whole 16-bit table for a float
    gather), and the rows are the table's own."""
    c = tiny_config(vocab=4096)
    w = random_weights(c, dtype="bfloat16")
    tokens = jnp.asarray([[5, 4095]], jnp.int32)
    np.testing.assert_array_equal(embed(w, tokens, c), np.asarray(w.emb, np.float32)[[[5, 4095]]])
    cache = KVCache.empty(c, 1, 16)
    one = jnp.ones(1, jnp.int32)
    step = jax.jit(lambda w, cache, t: cached.extend_unchecked(w, cache, t, one, c, native=True, window=16))
    assert f"f32[{c.vocab},{c.dim}]" not in step.lower(w, cache, tokens[:, :1]).compile().as_text()


def test_the_loaded_library_s_own_lists_are_this_package_s_and_another_s_is_refused(monkeypatch):
    """The library lists its handlers, the kinds whose matvec uses int8 limbs and (with tiles) those whose block
    products run on the tiles (library.cc, from handlers.h's, held.h's and tiles.h's traits) as `library`'s tables
    derive them; where they differ (a library built from other sources), the library is refused, saying which list
    differs and how."""
    (variant,) = (v for v in VARIANTS if v.name == kernels.status().variant)
    loaded = ctypes.CDLL(str(library._library_path(variant)))
    tiles = variant.name == "amx"
    assert library._disagreement(loaded, tiles) is None
    monkeypatch.setattr(library, "LIMBS", frozenset({"Q4_K", "Q6_K"}))
    expected = "x's int8 limbs in the matvec of ['Q4_K', 'Q5_K', 'Q6_K'], not of this package's ['Q4_K', 'Q6_K']"
    assert expected in str(library._disagreement(loaded, tiles))
    monkeypatch.undo()
    monkeypatch.setattr(library, "TILE_BLOCKS", frozenset({"Q8_0"}))
    listed = "['Q4_0', 'Q4_1', 'Q8_0']" if tiles else "[]"
    assert f"runs the block products of {listed} on AMX tiles" in str(library._disagreement(loaded, True))
    monkeypatch.setattr(library, "HANDLERS", (*library.HANDLERS, "LlamaJaxMatvecQ3_K"))
    assert "LlamaJaxMatvecQ3_K" in str(library._disagreement(loaded, tiles))
