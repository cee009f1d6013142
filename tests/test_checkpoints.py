"""Loaders against transformers on small random Llama models: checkpoints saved by transformers' own
save_pretrained (bf16; sharded f32) and GGUF files written as llama.cpp writes them (q/k rows permuted, each
supported tensor type), loaded by llama-jax and compared with what transformers computes from the same files."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

import llama_jax
from llama_jax import LlamaConfig
from llama_jax.loaders.gguf_file import dequantize
from llama_jax.testing import greedy
from tests.gguf_builder import write_gguf
from tests.helpers import hf_activations, hf_from_config, hf_greedy, hf_logits, save_hf_checkpoint

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

# (kv, g, half): grouped (g > 1), plain multi-head (g = 1), one kv head, odd numbers of heads
SHAPES = [(2, 2, 4), (4, 1, 4), (1, 4, 8), (3, 3, 2)]
IDS = [5, 17, 200, 3, 99, 256, 42, 7, 7, 130, 11, 250, 64, 1]


def config_of(kv: int, g: int, half: int, tied: bool = True, ffn: int = 48) -> LlamaConfig:
    return LlamaConfig(
        kv=kv, g=g, half=half, ffn=ffn, layers=3, vocab=260, eps=1e-5, theta=500.0, tied=tied, context=64
    )


def assert_matches_transformers(model: llama_jax.Model, hf) -> None:
    """Logits within 1e-4, every activation within rtol=atol=1e-4, the cached decode path equal to the full
    forward, greedy generation equal to transformers' generate."""
    ref = hf_activations(hf, IDS)
    mine = model.activations(IDS)
    for name in [*llama_jax.model_sites(model.config), "embeds", "nf", "logits"]:
        np.testing.assert_allclose(mine[name], ref[name], rtol=1e-4, atol=1e-4, err_msg=name)
    assert greedy(model.weights, model.config, IDS[:4], 12, eos_ids=()) == hf_greedy(hf, IDS[:4], 12)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "kv{}-g{}-half{}".format(*s))
def test_bf16_checkpoint_saved_by_transformers(tmp_path, shape):
    """bf16 safetensors: widened to f32 exactly by default; dtype="bfloat16" keeps bf16 and computes the same."""
    hf = hf_from_config(config_of(*shape), seed=sum(shape))
    directory = save_hf_checkpoint(tmp_path / "ckpt", hf, dtype="bfloat16")
    from transformers import AutoModelForCausalLM

    hf32 = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    model = llama_jax.load(directory)
    for name, array in model.weights.hf_tensors():
        np.testing.assert_array_equal(array, hf32.state_dict()[name].numpy(), err_msg=name)
    assert_matches_transformers(model, hf32)
    bf16 = llama_jax.load(directory, dtype="bfloat16")
    assert set(bf16.weights.held()) == {"bfloat16"}
    np.testing.assert_array_equal(bf16.logits(IDS), model.logits(IDS))


def test_f16_checkpoint_saved_by_transformers(tmp_path):
    """f16 safetensors are widened to f32 exactly."""
    hf = hf_from_config(config_of(2, 2, 4), seed=3)
    directory = save_hf_checkpoint(tmp_path / "ckpt", hf, dtype="float16")
    from transformers import AutoModelForCausalLM

    hf32 = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()
    model = llama_jax.load(directory)
    for name, array in model.weights.hf_tensors():
        np.testing.assert_array_equal(array, hf32.state_dict()[name].numpy(), err_msg=name)
    np.testing.assert_allclose(model.logits(IDS), hf_logits(hf32, IDS), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "kv{}-g{}-half{}".format(*s))
def test_sharded_f32_checkpoint_saved_by_transformers(tmp_path, shape):
    hf = hf_from_config(config_of(*shape, tied=False), seed=sum(shape) + 1)
    directory = save_hf_checkpoint(tmp_path / "ckpt", hf, dtype="float32", max_shard_size="60KB")
    assert len(list(directory.glob("model-*.safetensors"))) > 1
    model = llama_jax.load(directory)
    assert model.weights.lm_head is not None
    assert_matches_transformers(model, hf)


QUANT_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]


@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_dequantization_recovers_the_numbers_within_the_formats_rounding(type_name):
    """Each type's bytes, as gguf-py quantizes them, dequantize to the original numbers within a step of the
    format: relative rounding for the floats, a step of the block's scale for the quants."""
    qtype = gguf.GGMLQuantizationType[type_name]
    x = np.random.default_rng(0).standard_normal((8, 256)).astype(np.float32) * 3
    raw = gguf.quants.quantize(x, qtype)
    mine = dequantize(raw.view(np.uint8).ravel(), qtype).reshape(x.shape)
    error, scale = np.abs(mine - x), np.abs(x).max()  # the format's rounding: relative, or a step of its block
    bound = {"F32": 0 * x, "F16": 2**-11 * np.abs(x), "BF16": 2**-8 * np.abs(x), "Q8_0": scale / 127 + 0 * x}
    assert np.all(error <= bound.get(type_name, scale / 7 + 0 * x))


@pytest.mark.parametrize("type_name", QUANT_TYPES)
@pytest.mark.parametrize("shape", [(2, 2, 8), (4, 1, 8)], ids=["kv2-g2", "kv4-g1"])
def test_gguf_file_equals_transformers_loading_it(tmp_path, shape, type_name):
    """A GGUF written as llama.cpp writes it: llama-jax undoes the q/k permutation and dequantizes to exactly the
    tensors transformers reads from the same file, and computes its logits and activations."""
    config = config_of(*shape, ffn=64)
    model, hf = load_gguf_both_ways(tmp_path, config, type_name, seed=7)
    np.testing.assert_allclose(model.logits(IDS), hf_logits(hf, IDS), rtol=1e-4, atol=1e-4)
    assert model.config == config


def load_gguf_both_ways(tmp_path, config: LlamaConfig, type_name: str, seed: int):
    """A random model written as a GGUF of type_name (as llama.cpp writes it), loaded by llama-jax and by
    transformers; asserts that both read exactly the same tensors."""
    tensors = {n: p.detach().numpy() for n, p in hf_from_config(config, seed=seed).state_dict().items()}
    tensors.pop("lm_head.weight", None)
    path = write_gguf(tmp_path / "model.gguf", config, tensors, gguf.GGMLQuantizationType[type_name])
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    model = llama_jax.load(path)
    state = hf.state_dict()
    for name, array in model.weights.hf_tensors():
        np.testing.assert_array_equal(array, state[name].numpy(), err_msg=name)
    return model, hf


# types gguf-py dequantizes (random blocks where it cannot quantize): blocks of 32 or 256 numbers
MORE_TYPES = ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ2_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "TQ2_0"]


@pytest.mark.parametrize("type_name", MORE_TYPES)
def test_every_gguf_type_equals_transformers_loading_it(tmp_path, type_name):
    """A GGUF of a k-quant, i-quant or other type dequantizes by the gguf package's routines to exactly the
    tensors transformers reads from the same file, and gives its logits (to 1e-4 of their scale)."""
    config = LlamaConfig(kv=2, g=2, half=32, ffn=256, layers=2, vocab=260, eps=1e-5, theta=500.0, context=64)
    model, hf = load_gguf_both_ways(tmp_path, config, type_name, seed=3)
    expected = hf_logits(hf, IDS)
    assert np.isfinite(expected).all()
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(model.logits(IDS), expected, rtol=1e-4, atol=1e-4 * scale)


def test_loaded_weights_use_the_host_buffers_they_were_read_into(tmp_path):
    """Loading holds each weight once: an aligned host buffer becomes a JAX array without a copy (XLA's CPU device
    uses it in place), a misaligned one is copied once, and a loaded model computes what its file holds."""
    from llama_jax.loaders.tensors import _shared, host_buffer

    buffer = host_buffer((30, 7), np.float32)
    buffer[...] = np.arange(210).reshape(30, 7)
    assert _shared(buffer).unsafe_buffer_pointer() == buffer.ctypes.data
    shared = _shared(np.arange(10, dtype=np.float32)[1:])  # starts 4 bytes into its buffer: copied, then shared
    assert shared.unsafe_buffer_pointer() % 64 == 0 and np.array_equal(shared, np.arange(1, 10))
    config = config_of(2, 2, 4)
    hf = hf_from_config(config, seed=3)
    model = llama_jax.load(save_hf_checkpoint(tmp_path / "model", hf))
    np.testing.assert_allclose(model.logits(IDS), hf_logits(hf, IDS), atol=1e-4)


@pytest.mark.parametrize("native", ["auto", "off"])
def test_head_size_other_than_dim_over_heads(tmp_path, native):
    """head_dim 16 with hidden size 48 and 4 query heads (Mistral-Nemo's case: the queries 64 wide, not 48): q
    maps 48 to 64 numbers, o 64 back to 48. Every activation, the logits and greedy decoding as transformers, with
    the native kernels and XLA's products alike; a GGUF written as llama.cpp writes it (attention.key_length)
    gives the same config and logits."""
    config = LlamaConfig(kv=2, g=2, half=8, ffn=48, layers=3, vocab=260, eps=1e-5, theta=500.0, context=64, dim=48)
    assert (config.dim, config.qw, config.head_dim) == (48, 64, 16)
    hf = hf_from_config(config, seed=11)
    model = llama_jax.load(save_hf_checkpoint(tmp_path / "ckpt", hf), native=native)
    assert model.config == config
    assert_matches_transformers(model, hf)
    tensors = {n: p.detach().numpy() for n, p in hf.state_dict().items()}
    tensors.pop("lm_head.weight", None)
    from_gguf = llama_jax.load(write_gguf(tmp_path / "model.gguf", config, tensors), native=native)
    assert from_gguf.config == config
    np.testing.assert_allclose(from_gguf.logits(IDS), model.logits(IDS), rtol=1e-6, atol=1e-6)
