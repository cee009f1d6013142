"""Each array is described once (`llama_jax.core.arrays`): the checkpoint names and shapes the loaders check, the
pytrees' jaxtyping annotations, the shardings and the chex asserts at the jitted boundaries all come from it."""

from __future__ import annotations

import dataclasses
import typing

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh
from jax.sharding import PartitionSpec as P

from llama_jax import KVCache, LayerWeights, Weights, forward, prefill
from llama_jax.core import arrays
from llama_jax.core.sharding import cache_spec, weight_specs
from llama_jax.loaders.checkpoint import _gguf_names, hf_name
from llama_jax.loaders.tensors import hf_shapes
from llama_jax.testing import random_weights, tiny_config


def test_the_pytrees_fields_and_annotations_are_the_tables():
    for cls, table in ((LayerWeights, arrays.LAYER), (Weights, arrays.MODEL)):
        hints = typing.get_type_hints(cls)
        fields = [f.name for f in dataclasses.fields(cls) if f.name != "layers"]
        assert fields == list(table)
        for field in fields:
            assert f"'{table[field].annotation}'" in str(hints[field]), (field, hints[field])


def test_checkpoint_names_and_shapes_come_from_the_table():
    c = tiny_config(kv=2, g=3, half=4, ffn=40, layers=3, vocab=300, tied=False)
    shapes = hf_shapes(c)
    assert shapes["model.layers.2.self_attn.k_proj.weight"] == (c.kvw, c.dim)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (c.dim, c.ffn)
    assert shapes["lm_head.weight"] == (c.vocab, c.dim)
    assert len(shapes) == 3 * 9 + 3  # 9 arrays a layer: no bias, no per-head norm
    assert "lm_head.weight" not in hf_shapes(dataclasses.replace(c, tied=True))
    switched = dataclasses.replace(c, biases=("q", "o", "up"), head_norms=True)
    extra = set(hf_shapes(switched)) - set(shapes)
    assert len(extra) == 3 * 5
    assert hf_shapes(switched)["model.layers.1.self_attn.q_proj.bias"] == (c.qw,)
    assert hf_shapes(switched)["model.layers.1.self_attn.o_proj.bias"] == (c.dim,)
    assert hf_shapes(switched)["model.layers.2.mlp.up_proj.bias"] == (c.ffn,)
    assert hf_shapes(switched)["model.layers.0.self_attn.k_norm.weight"] == (c.head_dim,)
    for config in (c, switched):
        gguf = _gguf_names(config)
        assert sorted(gguf.values()) == sorted(hf_shapes(config))
        assert all(hf_name(g) == h for g, h in gguf.items())
    assert _gguf_names(switched)["blk.2.attn_q.bias"] == "model.layers.2.self_attn.q_proj.bias"


@pytest.mark.parametrize(
    ("model_size", "heads_split", "ffn_split"), [(1, True, True), (2, True, True), (3, False, False)]
)
def test_shardings_split_what_divides_and_replicate_the_rest(model_size, heads_split, ffn_split):
    c = tiny_config(kv=2, g=2, ffn=40)  # 4 heads in 2 kv groups; an MLP 40 wide
    mesh = AbstractMesh((2, model_size), ("data", "model"))
    specs = weight_specs(c, mesh)
    heads, ffn = ("model" if heads_split else None), ("model" if ffn_split else None)
    assert specs.layers.q == P(None, heads, None) and specs.layers.o == P(None, None, heads)
    assert specs.layers.gate == P(None, ffn, None) and specs.layers.down == P(None, None, ffn)
    assert specs.layers.ln1 == P(None, None) and specs.emb == P(None, None)
    assert cache_spec(c, 4, mesh) == P(None, "data", heads, None, None)
    assert cache_spec(c, 3, mesh) == P(None, None, heads, None, None)


def test_weights_that_do_not_fit_the_config_fail_the_chex_assert_when_traced():
    c = tiny_config()
    weights = random_weights(c)
    forward(weights, np.zeros((1, 4), np.int32), c)  # fits
    bad = dataclasses.replace(weights, layers=dataclasses.replace(weights.layers, k=weights.layers.k[:, :-1]))
    with pytest.raises(AssertionError, match="shape"):
        forward(bad, np.zeros((1, 4), np.int32), c)
    with pytest.raises(AssertionError, match="shape"):
        prefill(bad, KVCache.empty(c, 1, 32), np.zeros((1, 4), np.int32), c)


def test_a_cache_that_does_not_fit_the_config_fails_the_chex_assert_when_traced():
    c = tiny_config(kv=2)
    cache = KVCache.empty(tiny_config(kv=1, g=4), 1, 32)  # the same width, other kv heads
    with pytest.raises(AssertionError):
        prefill(random_weights(c), cache, np.zeros((1, 4), np.int32), c)
    chex.assert_shape(KVCache.empty(c, 2, 16).k, arrays.CACHE.shape(c, batch=2, capacity=16))
    assert KVCache.empty(c, 2, 16).k.dtype == jnp.float32


def test_the_annotations_are_checked_at_run_time_in_the_tests():
    """pyproject's jaxtyping hook: a call whose shapes contradict a compute function's annotation fails."""
    import jaxtyping

    from llama_jax.nn.norm import rms_norm

    with pytest.raises(jaxtyping.TypeCheckError):
        rms_norm(jnp.ones((2, 3, 8)), jnp.ones(5), 1e-5)  # gains of 5 for a last axis of 8
