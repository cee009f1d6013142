"""Scoring's native LM head (`kernels.score_head`, scoring.cc): at the scored rows only, the target's
log-probability equals float64's log-softmax of the same logits, the argmax is the logits' first maximum, the
vocabulary's log-probabilities follow from M and log S and the kept rows' logits in the same bits, rows with
target -1 are left uncomputed,
and a row's results are the same bits among any rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax import kernels
from llama_jax.core.quantized import dense

from .test_products import matrix, whole_blocks

pytestmark = pytest.mark.skipif(not kernels.status().active, reason=str(kernels.status()))


@pytest.mark.parametrize("held", ["float32", "bfloat16", "Q4_1", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("vocab", [32, 300, 1000])  # one chunk, a partial last chunk, several
def test_the_scored_rows_equal_float64_log_softmax(held, vocab):
    inner = whole_blocks(held, 96)
    w = matrix(held, vocab, inner, seed=vocab)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 9, inner)) * 8 * np.sqrt(96 / inner), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, (2, 9)), jnp.int32).at[0, 3].set(-1)  # one row not scored
    logprob, best, top, log_total, _ = jax.jit(kernels.score_head)(w, x, targets)
    logits = np.asarray(x, np.float64) @ np.asarray(dense(w).astype(jnp.float32), np.float64).T  # [2, 9, V]
    shifted = logits - logits.max(-1, keepdims=True)
    exact = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    want = np.take_along_axis(exact, np.maximum(np.asarray(targets), 0)[..., None], -1)[..., 0]
    scored = np.asarray(targets) >= 0
    np.testing.assert_allclose(np.asarray(logprob)[scored], want[scored], rtol=1e-5, atol=2e-5)
    # the block product's logits on the dequantized copy: the FMA kernels' bits, as the head's (bf16 weights' own
    # block products may run on AMX tiles instead: tests/test_tiles.py)
    native_logits = np.asarray(kernels.product(dense(w).astype(jnp.float32), x))
    np.testing.assert_array_equal(np.asarray(best)[scored], native_logits.argmax(-1)[scored])
    assert (np.asarray(logprob)[~scored] == 0).all() and (np.asarray(best)[~scored] == -1).all()
    whole = (native_logits - np.asarray(top)[..., None]) - np.asarray(log_total)[..., None]  # the vocabulary's
    chosen = np.take_along_axis(whole, np.maximum(np.asarray(targets), 0)[..., None], -1)[..., 0]
    np.testing.assert_array_equal(chosen[scored], np.asarray(logprob)[scored])
    keep = jnp.asarray([0, 2, 10, 17], jnp.int32)  # rows of x flattened: its logits, kept from the same pass
    *_, kept = jax.jit(kernels.score_head)(w, x, targets, keep)
    np.testing.assert_array_equal(np.asarray(kept), native_logits.reshape(-1, vocab)[np.asarray(keep)])


def test_a_divisor_divides_each_logit_before_the_log_softmax():
    """Granite's logits_scaling: the kernel's results are those of the logits divided by it (float64's), and a
    divisor of 1 is the same bits as none."""
    w = matrix("Q8_0", 300, 64, seed=3)
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((7, 64)) * 8, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 300, 7), jnp.int32)
    f = jax.jit(kernels.score_head, static_argnums=4)
    logprob, best, _, _, _ = f(w, x, targets, None, 8.0)
    logits = np.asarray(x, np.float64) @ np.asarray(dense(w), np.float64).T / 8.0
    shifted = logits - logits.max(-1, keepdims=True)
    exact = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    np.testing.assert_allclose(logprob, exact[np.arange(7), np.asarray(targets)], rtol=1e-5, atol=2e-5)
    np.testing.assert_array_equal(best, logits.argmax(-1))
    plain = jax.jit(kernels.score_head)(w, x, targets)
    for a, b in zip(f(w, x, targets, None, 1.0), plain, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_row_gets_the_same_bits_among_any_rows():
    w = matrix("Q4_1", 700, 64, seed=1)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((30, 64)) * 4, jnp.float32)
    targets = jnp.asarray(rng.integers(0, 700, 30), jnp.int32)
    f = jax.jit(kernels.score_head)
    whole = [np.asarray(a) for a in f(w, x, targets)]
    for start, count in ((0, 1), (7, 1), (3, 13), (17, 13)):
        part = f(w, x[start : start + count], targets[start : start + count])
        for a, b in zip(part, whole, strict=True):
            np.testing.assert_array_equal(np.asarray(a), b[start : start + count])
    masked = f(w, x, targets.at[::2].set(-1))  # the other rows not scored: the scored ones unchanged
    np.testing.assert_array_equal(np.asarray(masked[0])[1::2], whole[0][1::2])
