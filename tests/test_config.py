"""The config: the spec's fields and derived sizes, built from config.json files and GGUF metadata, and the
refusal of every feature the port does not run."""

from __future__ import annotations

from pathlib import Path

import pytest

from llama_jax import ConfigError, LlamaConfig
from llama_jax.loaders.gguf_file import GGUFFile

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize(
    ("name", "params", "sizes"),
    [
        ("smollm2-135m", 134_515_008, (576, 9, 64, 192)),
        ("smollm2-360m", 361_821_120, (960, 15, 64, 320)),
        ("smollm2-1.7b", 1_711_376_384, (2048, 32, 64, 2048)),
    ],
)
def test_smollm2_configs_give_the_spec_sizes_and_parameter_counts(name, params, sizes):
    """The spec's laws smollm2_*_sizes (dim, heads, head, kvw) and layout_* (the parameter counts)."""
    config = LlamaConfig.from_file(CONFIGS / f"{name}.json")
    assert (config.dim, config.heads, config.head_dim, config.kvw) == sizes
    assert config.param_count() == params
    assert config.tied


def test_spec_presets_equal_the_config_files():
    """The spec's Cfg values: (kv, g, half, ffn, layers, vocab, eps, theta)."""
    spec = {
        "smollm2-135m": (3, 3, 32, 1536, 30, 49152, 1e-5, 100000.0),
        "smollm2-360m": (5, 3, 32, 2560, 32, 49152, 1e-5, 100000.0),
        "smollm2-1.7b": (32, 1, 32, 8192, 24, 49152, 1e-5, 130000.0),
    }
    for name, (kv, g, half, ffn, layers, vocab, eps, theta) in spec.items():
        c = LlamaConfig.from_file(CONFIGS / f"{name}.json")
        assert (c.kv, c.g, c.half, c.ffn, c.layers, c.vocab) == (kv, g, half, ffn, layers, vocab)
        assert c == LlamaConfig(kv, g, half, ffn, layers, vocab, eps, theta, tied=True, context=8192)


def test_config_is_hashable_and_equal_configs_hash_equal():
    """jit specialises on the config as a static argument: it must hash, and by value."""
    a = LlamaConfig.from_file(CONFIGS / "smollm2-135m.json")
    b = LlamaConfig.from_hf(a.to_hf())
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.kv = 4  # frozen


def test_gguf_metadata_gives_the_same_config_as_config_json(default_path):
    """The default model's GGUF metadata (eps stored as f32) equals the 135M config.json."""
    f = GGUFFile(default_path)
    from_gguf = LlamaConfig.from_gguf(f.metadata, tied="output.weight" not in f.tensors, source=str(default_path))
    assert from_gguf == LlamaConfig.from_file(CONFIGS / "smollm2-135m.json")


def _hf(**changes):
    base = LlamaConfig.from_file(CONFIGS / "smollm2-135m.json").to_hf()
    return base | changes


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling 'llama3' needs the field"),
        (
            {"rope_scaling": {"type": "longrope", "factor": 2.0, "original_max_position_embeddings": 4096}},
            "'longrope' needs the field 'short_factor'",
        ),
        ({"rope_scaling": {"type": "su", "factor": 2.0}}, "RoPE scaling 'su' is not supported"),
        ({"model_type": "mistral", "attention_bias": True}, "attention_bias"),
        ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4096}, "sliding_window"),
        ({"model_type": "smollm3", "no_rope_layers": [1, 0]}, "one 0 or 1 per layer"),
        ({"model_type": "gemma2"}, "soft-capping and post-norms"),
        ({"sliding_window": 4096}, "sliding_window"),
        ({"head_dim": 7}, "head size 7 is not a positive even number"),
        ({"num_attention_heads": 8}, "not a positive multiple"),
        ({"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 580, "head_dim": None}, "not a multiple"),
        ({"hidden_size": 63, "num_attention_heads": 7, "num_key_value_heads": 7, "head_dim": None}, "9 is not a"),
        ({"hidden_act": "gelu"}, "silu"),
        ({"model_type": "gemma"}, "Llama-architecture"),
        ({"vocab_size": 0}, "vocab must be a positive integer"),
        ({"quantization_config": {"quant_method": "gptq"}}, "field 'quantization_config' .* a quantization"),
        ({"final_logit_softcapping": 30.0}, "field 'final_logit_softcapping' .* softcapping .* does not compute"),
        ({"num_local_experts": 8}, "'num_local_experts' .* a mixture of experts"),
    ],
)
def test_unsupported_features_are_refused_with_a_clear_message(changes, match):
    with pytest.raises(ConfigError, match=match):
        LlamaConfig.from_hf(_hf(**changes), source="test/config.json")


def test_fields_that_say_nothing_about_the_computation_are_accepted():
    """Ids, names, dtypes, transformers' output options, the fields fine-tuning tools and old conversions write
    (Unsloth's version and fix flag, an old conversion's max_sequence_length, pretraining_tp: the same products
    in slices), and computing fields left empty: accepted, as transformers' LlamaForCausalLM ignores them."""
    extras = {"bos_token_id": 0, "pad_token_id": None, "torch_dtype": "bfloat16", "output_attentions": False}
    tools = {"unsloth_version": "2024.9", "unsloth_fixed": True, "max_sequence_length": 4096, "pretraining_tp": 2}
    tools |= {"_attn_implementation_autoset": True, "mergekit_version": "0.0.5", "peft_type": None}
    empty = {"rope_interleaved": False, "quantization_config": None, "num_local_experts": 0}
    assert LlamaConfig.from_hf(_hf(**extras, **tools, **empty)) == LlamaConfig.from_hf(_hf())


def test_missing_field_is_named():
    hf = _hf()
    del hf["intermediate_size"]
    with pytest.raises(ConfigError, match="missing field 'intermediate_size'"):
        LlamaConfig.from_hf(hf, source="test/config.json")


def test_default_rope_parameters_of_transformers_5_are_accepted():
    """transformers 5 writes rope_parameters {rope_type: default, rope_theta} instead of rope_theta."""
    hf = _hf()
    del hf["rope_theta"]
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 130000.0}
    assert LlamaConfig.from_hf(hf).theta == 130000.0
