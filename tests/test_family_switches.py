"""The config's switches of the one Llama block, each against transformers' own model of the family that has it:
Qwen2's q/k/v biases, Qwen3's per-head norms of the queries and keys, SmolLM3's layers without RoPE, Granite's four
scalars, Llama's attention_bias and mlp_bias, and Phi-3's fused q/k/v and gate/up with a sliding window (8, past
which the 40 positions run). For a small random model of each (4 layers: SmolLM3's last one without RoPE): every
activation site and the logits as close to transformers' float64 as transformers' float32 is (within 2x, the
accuracy rule), on XLA's path and the native kernels'; the gradients of a loss at the layers' outputs and queries,
and of every array of a layer, equal transformers' autograd; greedy tokens equal `generate`'s; a GGUF written as
llama.cpp converts the family computes the same bits; and a sequence's prefill, decode and scored bits equal alone
and in a batch mixing lengths."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest

import llama_jax
from llama_jax import kernels, research
from llama_jax.core import arrays
from llama_jax.errors import InvalidArgumentError
from llama_jax.testing import greedy
from tests.gguf_builder import write_gguf
from tests.helpers import hf_activations, hf_from_json, hf_greedy, save_hf_checkpoint
from tests.test_batch_invariance import _run

torch = pytest.importorskip("torch")

SMALL = {
    "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "max_position_embeddings": 512, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
SWITCHES = {
    "qwen2": {"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 32768, "max_window_layers": 2},
    "qwen3": {"model_type": "qwen3", "head_dim": 32, "attention_bias": True},
    "smollm3": {"model_type": "smollm3", "no_rope_layers": [1, 1, 1, 0], "tie_word_embeddings": True,
                "pad_token_id": 0},
    "granite": {"model_type": "granite", "embedding_multiplier": 12.0, "residual_multiplier": 0.22,
                "attention_multiplier": 0.015625, "logits_scaling": 8.0},
    "llama-biases": {"model_type": "llama", "attention_bias": True, "mlp_bias": True},
    "phi3": {"model_type": "phi3", "sliding_window": 8, "original_max_position_embeddings": 512, "pad_token_id": 0},
}  # fmt: skip
IDS = [int(i) for i in np.random.default_rng(0).integers(0, 512, 40)]
TARGET = 17


def next_token_loss(logits):
    return -jax.nn.log_softmax(logits[-1])[TARGET]


@pytest.fixture(scope="module", params=sorted(SWITCHES))
def family(request, tmp_path_factory) -> tuple[str, object, Path]:
    """A family's random transformers model (f32) and its Hugging Face directory."""
    fields = SMALL | SWITCHES[request.param]
    hf = hf_from_json(fields, seed=7)
    directory = save_hf_checkpoint(tmp_path_factory.mktemp(request.param) / "hf", hf)
    (directory / "config.json").write_text(json.dumps(fields))
    return request.param, hf, directory


def test_the_config_says_each_family_s_switch(family):
    name, _, directory = family
    config = llama_jax.load(directory, native="off").config
    said = {
        "qwen2": config.biases == ("q", "k", "v"),
        "qwen3": config.head_norms and config.biases == ("q", "k", "v", "o"),
        "smollm3": config.nope_layers == (3,) and config.rope_layers == (True, True, True, False),
        "granite": (config.embedding_multiplier, config.logits_scaling, config.attention_scale) == (12.0, 8.0, 2**-6),
        "llama-biases": config.biases == ("q", "k", "v", "o", "gate", "up", "down"),
        "phi3": config.sliding_window == 8 and config.family == "phi3",
    }
    assert said[name], config
    assert llama_jax.LlamaConfig.from_hf(config.to_hf()) == config


@pytest.mark.parametrize("native", ["off", "require"])
def test_every_site_and_the_logits_are_as_close_to_float64_as_transformers_float32(family, native):
    """Each site (the rotated queries and keys of the layers with RoPE: transformers' apply_rotary_pos_emb is not
    called in SmolLM3's layer without it) within 2x of transformers float32's distance from its float64, floored at
    1e-6 of the site's size."""
    if native == "require" and not kernels.status().active:
        pytest.skip(str(kernels.status()))
    name, hf, directory = family
    model = llama_jax.load(directory, native=native)
    f64, f32 = hf_activations(hf.double(), IDS), hf_activations(hf.float(), IDS)
    hf.float()
    mine = model.activations(IDS, keep=True)
    f64["embeds"] = f64["embeds"] * model.config.embedding_multiplier  # the first layer's input (Granite's scaled)
    f32["embeds"] = f32["embeds"] * np.float32(model.config.embedding_multiplier)
    for site in ("embeds", *llama_jax.model_sites(model.config), "nf", "logits"):
        got = (
            mine[site]
            if site in ("embeds", "nf", "logits") or name != "smollm3" or site not in ("qr", "kr")
            else (mine[site][:3])
        )
        exact, theirs = f64[site].astype(np.float64), f32[site]
        floor = 1e-6 * float(np.abs(exact).max())
        distance, ours = float(np.abs(theirs - exact).max()), float(np.abs(got - exact).max())
        assert ours <= 2 * max(distance, floor), f"{name} {site}: {ours:.2e} against transformers f32 {distance:.2e}"


def test_a_gguf_written_as_llama_cpp_converts_the_family_computes_the_directory_s_bits(family, tmp_path):
    """The family's architecture, keys and tensors (biases, per-head norms; q, k and their biases permuted where
    llama.cpp's converter permutes them) read back to the same config and weights: the same logits, bit for bit."""
    _, hf, directory = family
    from_dir = llama_jax.load(directory)
    tensors = {
        n: p.detach().numpy() for n, p in hf.state_dict().items() if n != "lm_head.weight" or not from_dir.config.tied
    }
    path = write_gguf(tmp_path / "model.gguf", from_dir.config, tensors)
    from_gguf = llama_jax.load(path)
    assert dataclasses.replace(from_gguf.config, context=from_dir.config.context) == from_dir.config
    np.testing.assert_array_equal(from_gguf.logits(IDS), from_dir.logits(IDS))


def test_greedy_tokens_equal_transformers_generate(family):
    _, hf, directory = family
    expected = hf_greedy(hf, IDS[:8], 12)
    for native in ("off", "auto"):
        model = llama_jax.load(directory, native=native)
        assert greedy(model.weights, model.config, IDS[:8], 12, eos_ids=(), native=model.native.active) == expected


def test_gradients_at_the_layer_outputs_and_queries_and_of_a_layer_s_weights_equal_transformers_autograd(family):
    """research.activation_grads of the last position's log-probability of a token, at y and q of every layer, and
    research.weight_grads of every array of layer 1 (its biases and per-head norms included), against
    transformers' autograd (through its hooks; its parameters' grads): allclose(rtol=1e-3, atol=1e-3·max|grad|)."""
    _, hf, directory = family
    model = llama_jax.load(directory)
    _, grads = research.activation_grads(model, IDS, next_token_loss, ("y", "q"))
    kept = {}

    def keep(name, i):
        def hook(_module, _inputs, output):
            out = output[0] if isinstance(output, tuple) else output
            out.retain_grad()
            kept[name, i] = out

        return hook

    handles = []
    for i, layer in enumerate(hf.model.layers):
        handles.append(layer.register_forward_hook(keep("y", i)))
        if hasattr(layer.self_attn, "q_proj"):  # (Phi-3's q is rows of qkv_proj: its weight's gradient below)
            handles.append(layer.self_attn.q_proj.register_forward_hook(keep("q", i)))
    hf.zero_grad()
    try:
        logits = hf(torch.tensor([IDS])).logits[0]
        (-torch.log_softmax(logits[-1], -1)[TARGET]).backward()
    finally:
        for h in handles:
            h.remove()
    for (site, i), value in kept.items():
        ref = value.grad[0].numpy()
        np.testing.assert_allclose(grads[site][i], ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max(), err_msg=f"{site} {i}")
    chosen = research.weight_grads(model, IDS, next_token_loss, layers=(1,))  # every array of layer 1, biases too
    fused = {f: hf_name.format(1) for hf_name, _, fields in arrays.FUSED for f in fields}
    for field, spec in arrays.LAYER.items():
        if not spec.present(model.config):
            continue
        got = np.asarray(getattr(chosen, field))[0]
        if model.config.family in arrays.FUSED_FAMILIES and field in fused:  # its rows of the fused weight's grad
            parts = [f for hf_name, _, fields in arrays.FUSED if hf_name.format(1) == fused[field] for f in fields]
            rows = [arrays.LAYER[f].checkpoint_shape(model.config)[0] for f in parts]
            start = sum(rows[: parts.index(field)])
            ref = hf.get_parameter(fused[field]).grad.numpy()[start : start + got.shape[0]]
        else:
            ref = hf.get_parameter(spec.hf.format(1)).grad.numpy()
        np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max(), err_msg=field)


def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch_of_mixed_lengths(family):
    """On the native kernels and XLA's path (its decode step from batch 2 up: docs/numerics.md), at head sizes of
    16 and 32 (Qwen3's row)."""
    _, _, directory = family
    model = llama_jax.load(directory)
    target, others = IDS[:13], [IDS[5:40], IDS[:2], IDS[20:27]]
    batch = [others[0], target, *others[1:]]
    for native in [True, False] if model.native.active else [False]:
        alone, together = _run(model, [target], native), _run(model, batch, native)
        np.testing.assert_array_equal(together[0][1], alone[0][0], "prefill logits")
        if native:
            np.testing.assert_array_equal(together[1][1], alone[1][0], "decoded tokens")
            np.testing.assert_array_equal(together[2][1], alone[2][0], "decode logits")
        else:  # batch 1 against batch 2: the step's exp (docs/numerics.md); 4 sequences against a batch of 2
            pair = _run(model, [target, others[1]], native)
            np.testing.assert_array_equal(together[2][1], pair[2][0], "decode logits")
    scored = model.score(batch, batch_size=4)[1]
    np.testing.assert_array_equal(scored.logprobs, model.score([target], batch_size=1)[0].logprobs)


def test_the_per_head_norm_sites_are_a_model_s_only_where_it_has_the_norms(family):
    """qn and kn (Qwen3's q_norm, k_norm outputs) are sites of a model with head_norms only: keep=True leaves them
    out elsewhere, and asking for them there (keep, an edit, a store's site) is an error naming what is missing."""
    name, _, directory = family
    model = llama_jax.load(directory)
    kept = model.activations(IDS[:5], keep=True)
    assert ("qn" in kept and "kn" in kept) == (name == "qwen3") == model.config.head_norms
    if name == "qwen3":
        return
    with pytest.raises(InvalidArgumentError, match=r"\['qn'\] are the queries' and keys' per-head norms"):
        model.activations(IDS[:5], keep="qn")
    zeros = research.zero_interventions(model.config, 1, 5)
    assert zeros.qn is None and zeros.kn is None
    edit = llama_jax.sparse_act(kn=jax.numpy.zeros((model.config.layers, 1, 5, model.config.kvw)))
    with pytest.raises(InvalidArgumentError, match="per-head norms"):
        llama_jax.forward(model.weights, np.asarray([IDS[:5]]), model.config, add=edit)
