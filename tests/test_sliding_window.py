"""Mistral's sliding window against transformers' MistralForCausalLM: a query sees its own position and the
window - 1 before it (`causal_mask`), on XLA's attention and the native kernels alike (the block attention of
prefill and scoring, the decode step's), past the window: every activation, the logits, greedy decoding from the
cache; a config.json of model_type mistral without a window is a Llama."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax import LlamaConfig
from llama_jax.nn.attention import causal_mask
from llama_jax.passes.generate import token_steps
from tests.helpers import hf_activations, hf_from_config, hf_greedy, hf_logits, save_hf_checkpoint

torch = pytest.importorskip("torch")

CONFIG = LlamaConfig(kv=2, g=2, half=4, ffn=48, layers=3, vocab=260, theta=500.0, context=64, sliding_window=8)
IDS = np.random.default_rng(1).integers(0, 260, 40).tolist()  # five windows long


def test_the_mask_sees_the_window_ending_at_each_position():
    """Position p sees slots p - 7 .. p with a window of 8 (none before slot 0), and slots 0 .. p without one."""
    positions = jnp.arange(12, dtype=jnp.int32)[None]
    mask = np.asarray(causal_mask(positions, 12, 8))[0]
    assert [np.flatnonzero(row).tolist() for row in mask][9] == list(range(2, 10))
    assert mask.sum(axis=1).tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 8, 8, 8, 8]
    assert np.asarray(causal_mask(positions, 12))[0].sum(axis=1).tolist() == list(range(1, 13))


@pytest.mark.slow
@pytest.mark.parametrize("native", ["auto", "off"])
def test_mistral_with_a_window_equals_transformers(tmp_path, native):
    """A random MistralForCausalLM with a window of 8, 40 positions: every activation (the pattern zero outside
    the window) and the logits within 1e-4, greedy decoding from the cache (positions 20-35) equal to
    transformers' generate; the native kernels and XLA's attention alike."""
    hf = hf_from_config(CONFIG, seed=2)
    assert type(hf).__name__ == "MistralForCausalLM"
    model = llama_jax.load(save_hf_checkpoint(tmp_path / "ckpt", hf), native=native)
    assert model.config == CONFIG
    ref, mine = hf_activations(hf, IDS), model.activations(IDS)
    for name in [*llama_jax.model_sites(model.config), "logits"]:
        np.testing.assert_allclose(mine[name], ref[name], rtol=1e-4, atol=1e-4, err_msg=name)
    assert not mine["pattern"][:, :, 20, :12].any()  # position 20 sees 13..20 only
    expected = hf_greedy(hf, IDS[:20], 16)
    steps = token_steps(model.weights, model.config, [IDS[:20]], 16, native=model.native.active)
    assert [int(step[0]) for step in steps] == expected


@pytest.mark.slow
def test_mistral_without_a_window_is_a_llama(tmp_path):
    """model_type mistral with sliding_window null (Mistral 7B v0.2 and later): the Llama config, its logits."""
    hf = hf_from_config(CONFIG, seed=3)
    hf.config.sliding_window = None
    directory = save_hf_checkpoint(tmp_path / "ckpt", hf)
    model = llama_jax.load(directory)
    assert model.config == LlamaConfig(kv=2, g=2, half=4, ffn=48, layers=3, vocab=260, theta=500.0, context=64)
    np.testing.assert_allclose(model.logits(IDS), hf_logits(hf, IDS), rtol=1e-4, atol=1e-4)
