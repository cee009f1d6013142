"""TransformerLens' names: `run_with_cache` gives, under each classic hook name and in TransformerLens' layout,
the numbers transformers computes at that point (its own forward hooks), and takes names_filter as
TransformerLens does."""

from __future__ import annotations

import numpy as np
import pytest

import llama_jax
from llama_jax import LlamaConfig
from llama_jax.lens import TRANSFORMER_LENS, hook_names, run_with_cache
from tests.helpers import hf_activations, hf_from_config, save_hf_checkpoint

torch = pytest.importorskip("torch")

IDS = [5, 17, 200, 3, 99, 256, 42, 7, 7, 130, 11]
CONFIG = LlamaConfig(kv=2, g=3, half=4, ffn=40, layers=3, vocab=260, eps=1e-5, theta=500.0, tied=True, context=64)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_from_config(CONFIG, seed=4)
    return llama_jax.load(save_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), hf)), hf


def transformers_in_lens_layout(hf, ids) -> dict[str, np.ndarray]:
    """transformers' intermediates (tests.helpers' hooks), laid out as TransformerLens lays out each hook, batch 1."""
    ref = hf_activations(hf, ids)
    t, n, k, h = len(ids), CONFIG.heads, CONFIG.kv, CONFIG.head_dim
    out = {"hook_embed": ref["embeds"][None]}
    for i in range(CONFIG.layers):
        by_hook = {
            "hook_resid_pre": ref["embeds"] if i == 0 else ref["y"][i - 1],
            "attn.hook_q": ref["q"][i].reshape(t, n, h),
            "attn.hook_k": ref["k"][i].reshape(t, k, h),
            "attn.hook_v": ref["v"][i].reshape(t, k, h),
            "attn.hook_rot_q": ref["qr"][i].reshape(t, n, h),
            "attn.hook_rot_k": ref["kr"][i].reshape(t, k, h),
            "attn.hook_pattern": ref["pattern"][i],
            "attn.hook_z": ref["attn"][i].reshape(t, n, h),
            "hook_attn_out": ref["a"][i],
            "hook_resid_mid": ref["mid"][i],
            "mlp.hook_post": ref["hidden"][i],
            "hook_mlp_out": ref["m"][i],
            "hook_resid_post": ref["y"][i],
        }
        out |= {f"blocks.{i}.{hook}": value[None] for hook, value in by_hook.items()}
    return out


def test_every_hook_holds_what_transformers_computes_there(pair):
    """Each of the 40 hooks of a 3-layer grouped-query model (6 query heads, 2 kv heads) against transformers'
    intermediates in TransformerLens' shapes (pattern [batch, head, query, key], z [batch, pos, head, d_head]):
    allclose with rtol=atol=1e-4; the logits too."""
    model, hf = pair
    logits, cache = run_with_cache(model, IDS)
    ref = transformers_in_lens_layout(hf, IDS)
    assert list(cache) == hook_names(CONFIG) and set(cache) == set(ref)
    for name, value in cache.items():
        assert value.shape == ref[name].shape, name
        np.testing.assert_allclose(value, ref[name], rtol=1e-4, atol=1e-4, err_msg=name)
    assert cache["blocks.1.attn.hook_pattern"].shape == (1, 6, len(IDS), len(IDS))
    assert cache["blocks.1.attn.hook_z"].shape == (1, len(IDS), 6, 8)
    np.testing.assert_allclose(logits[0], hf_activations(hf, IDS)["logits"], rtol=1e-4, atol=1e-4)


def test_names_filter_takes_a_name_a_list_or_a_predicate(pair):
    """names_filter as TransformerLens takes it; the values equal those of the unfiltered run."""
    model, _ = pair
    _, everything = run_with_cache(model, IDS)
    _, one = run_with_cache(model, IDS, names_filter="blocks.2.attn.hook_pattern")
    _, listed = run_with_cache(
        model, IDS, names_filter=["hook_embed", "blocks.0.hook_resid_pre", "blocks.1.mlp.hook_post"]
    )
    _, matched = run_with_cache(model, IDS, names_filter=lambda name: name.endswith("hook_resid_post"))
    assert list(one) == ["blocks.2.attn.hook_pattern"]
    assert list(listed) == ["hook_embed", "blocks.0.hook_resid_pre", "blocks.1.mlp.hook_post"]
    assert list(matched) == [f"blocks.{i}.hook_resid_post" for i in range(CONFIG.layers)]
    for cache in (one, listed, matched):
        for name, value in cache.items():
            np.testing.assert_array_equal(value, everything[name], err_msg=name)


def test_a_batch_holds_each_sequence_as_run_alone(pair):
    model, _ = pair
    other = [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 100]
    logits, cache = run_with_cache(model, [IDS, other], names_filter="blocks.0.hook_resid_mid")
    for b, ids in enumerate([IDS, other]):
        alone_logits, alone = run_with_cache(model, ids, names_filter="blocks.0.hook_resid_mid")
        np.testing.assert_array_equal(logits[b], alone_logits[0])
        np.testing.assert_array_equal(cache["blocks.0.hook_resid_mid"][b], alone["blocks.0.hook_resid_mid"][0])


def test_unknown_hooks_and_ragged_batches_are_refused(pair):
    model, _ = pair
    with pytest.raises(
        llama_jax.InvalidArgumentError, match=r"no TransformerLens hook named \['blocks.3.hook_resid_post'\]"
    ):
        run_with_cache(model, IDS, names_filter=["blocks.3.hook_resid_post"])
    with pytest.raises(llama_jax.InvalidArgumentError, match=r"one token length; got lengths \[11, 2\]"):
        run_with_cache(model, [IDS, [1, 2]])


def test_the_table_names_an_existing_site_for_every_hook():
    assert set(TRANSFORMER_LENS.values()) - {"embeds", "resid_pre"} <= set(llama_jax.ACT_NAMES)
