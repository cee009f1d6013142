"""The spec's structural laws as property tests: head split/join, the grouped-query mapping, causality, the
cache's capacity (kv_room) and token ids inside the vocabulary."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

from llama_jax import CapacityError, KVCache, TokenIdError, decode_step, extend, forward, prefill
from llama_jax.nn.attention import group_heads
from llama_jax.nn.rope import apply_rope
from llama_jax.testing import attention, random_weights, tiny_config

SETTINGS = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# each new shape compiles: fewer examples where every example has a new one
FEW = settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# jitted: one compilation per shape, where run eagerly each of the invariant softmax's many operations compiles for
# every new shape (several times slower)
_apply_rope = jax.jit(apply_rope)
_attention = jax.jit(attention)


@functools.cache
def tiny(kv=2, g=2, half=4):
    config = tiny_config(kv=kv, g=g, half=half)
    return config, random_weights(config, seed=kv * 100 + g * 10 + half)


@SETTINGS
@given(n=st.integers(1, 4), half=st.integers(1, 8), t=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_head_split_and_join_is_the_identity(n, half, t, seed):
    """head_split: splitting each head into the two halves RoPE pairs and joining them loses and reorders nothing
    (RoPE at angle 0 is exactly split then join)."""
    x = np.random.default_rng(seed).standard_normal((1, t, n, 2 * half)).astype(np.float32)
    ones, zeros = jnp.ones((1, t, half)), jnp.zeros((1, t, half))
    np.testing.assert_array_equal(np.asarray(_apply_rope(jnp.asarray(x), ones, zeros)), x)


@FEW
@given(kv=st.integers(1, 4), g=st.integers(1, 4), h=st.sampled_from([2, 4, 8]), s=st.integers(1, 6))
def test_query_head_j_g_plus_i_reads_kv_head_j(kv, g, h, s):
    """gqa_head: with every key equal (uniform attention) and the values of kv head j all equal to j + 1, the
    output of query head n is n // g + 1: query head j·g + i reads kv head j."""
    rng = np.random.default_rng(kv * 31 + g)
    q = jnp.asarray(rng.standard_normal((1, s, kv * g, h)), jnp.float32)
    k = jnp.zeros((1, kv, s, h))
    v = jnp.broadcast_to(jnp.arange(1, kv + 1, dtype=jnp.float32)[None, :, None, None], (1, kv, s, h))
    mask = jnp.tril(jnp.ones((s, s), bool))[None]
    out = np.asarray(_attention(q, k, v, mask))  # [1, T, N, H]
    expected = (np.arange(kv * g) // g + 1).astype(np.float32)
    np.testing.assert_allclose(out, np.broadcast_to(expected[None, None, :, None], out.shape), rtol=1e-6)
    assert group_heads(q, kv).shape == (1, s, kv, g, h)


@SETTINGS
@given(kv=st.integers(1, 3), g=st.integers(1, 3), s=st.integers(1, 7), seed=st.integers(0, 1000))
def test_grouped_attention_equals_attention_over_repeated_keys(kv, g, s, seed):
    """Grouping without repeating keys computes transformers' repeat_kv attention (a plain numpy reference)."""
    h = 4
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, s, kv * g, h)).astype(np.float32)
    k = rng.standard_normal((1, kv, s, h)).astype(np.float32)
    v = rng.standard_normal((1, kv, s, h)).astype(np.float32)
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)  # repeat_kv: [1, N, S, H]
    scores = np.einsum("btnh,bnsh->bnts", q, kr) / np.sqrt(h)
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    expected = np.einsum("bnts,bnsh->btnh", w, vr)
    mask = jnp.tril(jnp.ones((s, s), bool))[None]
    out = _attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), mask)
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-6)


_forward = jax.jit(forward, static_argnames=("config", "keep"))


@SETTINGS
@given(
    shape=st.sampled_from([(2, 2, 4), (1, 4, 2), (3, 1, 4)]),
    length=st.integers(2, 12),
    data=st.data(),
)
def test_causality_later_tokens_leave_earlier_logits_unchanged(shape, length, data):
    """causal: changing the tokens after position t leaves the logits at positions ≤ t exactly unchanged."""
    config, weights = tiny(*shape)
    t = data.draw(st.integers(0, length - 2))
    ids = np.array(data.draw(st.lists(st.integers(0, config.vocab - 1), min_size=length, max_size=length)))
    other = ids.copy()
    other[t + 1 :] = (ids[t + 1 :] + data.draw(st.integers(1, config.vocab - 1))) % config.vocab
    a, _ = _forward(weights, ids[None], config)
    b, _ = _forward(weights, other[None], config)
    np.testing.assert_array_equal(np.asarray(a[0, : t + 1]), np.asarray(b[0, : t + 1]))
    assert not np.array_equal(np.asarray(a[0, t + 1 :]), np.asarray(b[0, t + 1 :]))


@FEW
@given(capacity=st.integers(1, 12), data=st.data())
def test_the_cache_refuses_a_position_at_or_past_its_capacity(capacity, data):
    """kv_room: positions 0..capacity-1 can be written; the next write raises CapacityError before anything is
    written (the cache passed in is still valid and unchanged)."""
    config, weights = tiny()
    filled = data.draw(st.integers(1, capacity))
    cache = KVCache.empty(config, 1, capacity)
    _, cache = prefill(weights, cache, np.ones((1, filled), np.int32), config)
    for _ in range(capacity - filled):
        _, cache = decode_step(weights, cache, np.array([3]), config)
    assert cache.length.tolist() == [capacity]
    k_before = np.asarray(cache.k)
    with pytest.raises(CapacityError, match=f"capacity is {capacity}"):
        decode_step(weights, cache, np.array([3]), config)
    with pytest.raises(CapacityError, match=f"capacity is {capacity}"):
        prefill(weights, cache, np.ones((1, 1), np.int32), config)
    np.testing.assert_array_equal(np.asarray(cache.k), k_before)
    assert cache.length.tolist() == [capacity]


def test_the_capacity_check_also_holds_inside_jitted_code():
    """`extend` composed into a user's own jitted function: under checkify, a write past the capacity is an error
    (dynamic_update_slice alone would clamp it onto the last slot)."""
    config, weights = tiny()
    step = jax.jit(checkify.checkify(functools.partial(extend, config=config), errors=checkify.user_checks))
    cache = KVCache.empty(config, 1, 4)
    err, (_, cache) = step(weights, cache, jnp.ones((1, 3), jnp.int32), jnp.array([3]))
    assert err.get() is None
    err, _ = step(weights, cache, jnp.ones((1, 2), jnp.int32), jnp.array([2]))
    assert "KV cache full" in err.get() and "capacity 4" in err.get()


@pytest.mark.parametrize("bad", [-1, 260, 10**6])
def test_token_ids_outside_the_vocabulary_are_refused(bad):
    """A JAX gather would clamp an id ≥ vocab or < 0 to a valid row; every entry point refuses it, naming the id
    and the vocabulary size, on the host and inside jitted code."""
    config, weights = tiny()
    cache = KVCache.empty(config, 1, 8)
    with pytest.raises(TokenIdError, match=rf"token id {bad} is outside the vocabulary \[0, 260\)"):
        prefill(weights, cache, np.array([[1, bad]]), config)
    with pytest.raises(TokenIdError, match=rf"token id {bad} "):
        decode_step(weights, cache, np.array([bad]), config)
    step = jax.jit(checkify.checkify(functools.partial(extend, config=config), errors=checkify.user_checks))
    err, _ = step(weights, cache, jnp.array([[1, bad]], jnp.int32), jnp.array([2]))
    assert f"token id {bad} is outside the vocabulary [0, 260)" in err.get()
