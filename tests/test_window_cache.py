"""A window-only KV cache (`KVCache.window_only`): a model with a sliding window keeps its last `window` positions
in a ring (position p at slot p mod window, written over only once the window has passed it) and computes what
the whole cache computes, past the window, on XLA's attention and the native kernels; until it wraps, the same
bits, so generation, which holds the window only where a batch needs more positions, stays batch invariant."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax import KVCache, LlamaConfig, decode_step, forward, kernels, prefill
from llama_jax.core.kv_cache import ring_view, write_ring_layer
from llama_jax.errors import InvalidArgumentError
from llama_jax.passes.decode_batch import DecodeBatch, RowSettings
from llama_jax.passes.sampling import Sampling
from llama_jax.testing import random_weights

CONFIG = LlamaConfig(kv=2, g=2, half=4, ffn=48, layers=2, vocab=260, theta=500.0, context=64, sliding_window=16)
WEIGHTS = random_weights(CONFIG, seed=3)
IDS = np.random.default_rng(4).integers(0, 260, 60)
NATIVE = [False, pytest.param(True, marks=pytest.mark.skipif(not kernels.status().active, reason="no kernels"))]


def _filled_ring(length: np.ndarray, slots: int) -> np.ndarray:
    """A ring [1, B, 1, S, 1] whose slot s holds the newest position p < length[b] with p ≡ s (mod S), -1 if none."""
    ring = np.full((1, len(length), 1, slots, 1), -1.0, np.float32)
    for b, n in enumerate(length):
        for p in range(n):
            ring[0, b, 0, p % slots, 0] = p
    return ring


def test_the_ring_keeps_the_newest_real_position_of_each_slot():
    """A block of T positions (T past the ring's size, padding after each row's real ones) written over rings
    of different fillings: each slot then holds the newest real position of its residue, the padding nowhere."""
    slots, t = 8, 12
    length, n = np.array([0, 3, 8, 21]), np.array([12, 2, 9, 5])
    ring = _filled_ring(length, slots)
    new = (length[:, None] + np.arange(t))[:, None, :, None].astype(np.float32)  # [B, 1, T, 1]: the positions
    new = np.where(np.arange(t)[None, None, :, None] < n[:, None, None, None], new, -2.0)  # padding: -2
    k, v = write_ring_layer(jnp.asarray(ring), jnp.asarray(ring), jnp.int32(0), jnp.asarray(length), jnp.asarray(n),
                            jnp.asarray(new), jnp.asarray(new))  # fmt: skip
    np.testing.assert_array_equal(k, _filled_ring(length + n, slots))
    np.testing.assert_array_equal(v, k)


def test_the_ring_view_lists_the_held_positions_in_order_then_the_block():
    """Slot r of the view holds position max(length - S, 0) + r: the ring's positions oldest first, then the new
    block's, then copies of its last (hidden by the causal mask), in a power of two of slots."""
    slots, t = 8, 3
    length = np.array([0, 5, 8, 13])
    ring = jnp.asarray(_filled_ring(length, slots))
    new = jnp.asarray((length[:, None] + np.arange(t))[:, None, :, None].astype(np.float32))  # [B, 1, T, 1]
    keys, values = ring_view(ring, ring, jnp.int32(0), jnp.asarray(length), new, new)  # [B, 1, R, 1] each
    assert keys.shape[2] == 16
    for b, n in enumerate(length):
        base = max(n - slots, 0)
        held = np.arange(base, n + t)
        np.testing.assert_array_equal(keys[b, 0, : held.size, 0], held)
        assert (keys[b, 0, held.size :, 0] == n + t - 1).all()
    np.testing.assert_array_equal(values, keys)


@pytest.mark.parametrize("native", NATIVE)
def test_a_window_only_cache_computes_the_forward_pass_past_the_window(native):
    """Two sequences in a ring of the window's 16 slots: a prefill (one row longer than the window), a second
    prefill block that wraps the ring (padded rows), then decode steps to position 56: every logits within 2e-5
    of `forward`'s over the whole sequence (no cache); the cache holds 16 slots throughout."""
    whole = jax.jit(forward, static_argnames=("config", "native"))  # one program, not an eager op each
    ref = np.asarray(whole(WEIGHTS, np.stack([IDS, IDS[::-1]]), CONFIG, native=native)[0])  # [2, 60, V]
    rows = np.stack([IDS, IDS[::-1]])
    cache = KVCache.window_only(CONFIG, 2)
    seen = np.zeros(2, int)
    for block, n in ((32, [5, 20]), (32, [24, 12])):
        ids = np.zeros((2, block), np.int32)
        for b in range(2):
            ids[b, : n[b]] = rows[b, seen[b] : seen[b] + n[b]]
        logits, cache = prefill(WEIGHTS, cache, ids, CONFIG, n=n, native=native)
        seen += n
        np.testing.assert_allclose(logits, ref[[0, 1], seen - 1], atol=2e-5, rtol=0)
    for _ in range(24):
        logits, cache = decode_step(WEIGHTS, cache, rows[[0, 1], seen], CONFIG, native=native)
        seen += 1
        np.testing.assert_allclose(logits, ref[[0, 1], seen - 1], atol=2e-5, rtol=0)
    assert cache.ring and cache.capacity == 16 and np.asarray(cache.length).tolist() == [53, 56]


def _generate(prompts, capacity, native):
    """A DecodeBatch prefilled for `capacity` positions and one chunk advanced: whether its cache is a ring, the
    logits after each prompt, the tokens and the logits after them."""
    settings = RowSettings.of(Sampling(), np.zeros(len(prompts), np.uint32), CONFIG.vocab)
    batch = DecodeBatch.prefill(WEIGHTS, CONFIG, prompts, capacity, settings, native)
    first = np.asarray(batch.logits)
    batch, tokens, _ = batch.advance(WEIGHTS, CONFIG, native)
    return batch.cache.ring, first, tokens, np.asarray(batch.logits)


@pytest.mark.parametrize("native", NATIVE)
def test_generation_holds_the_window_only_where_a_batch_needs_more_and_stays_batch_invariant(native):
    """A batch whose positions fit the window holds them all; one with a prompt longer than the window holds the
    window only. A short prompt's logits and tokens are the same bits in either (a ring that has not wrapped
    computes as the whole cache), and a long prompt's the same beside any other prompt."""
    short, long, other = IDS[:5], IDS[5:35], IDS[40:46]
    whole = _generate([short, other], 16, native)
    mixed = _generate([short, long], 64, native)
    beside = _generate([other, long], 64, native)
    assert not whole[0] and mixed[0] and beside[0]
    for a, b in zip(whole[1:], mixed[1:], strict=True):
        np.testing.assert_array_equal(a[0], b[0])
    for a, b in zip(mixed[1:], beside[1:], strict=True):
        np.testing.assert_array_equal(a[1], b[1])


def test_a_window_only_cache_needs_a_sliding_window():
    """A model that attends to every position cannot drop any: its window-only cache is refused, naming why."""
    with pytest.raises(InvalidArgumentError, match="needs a model with a sliding window"):
        KVCache.window_only(LlamaConfig(kv=2, g=2, half=4, ffn=48, layers=2, vocab=260), 1)
