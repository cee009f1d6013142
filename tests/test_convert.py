"""convert: GGUF → Hugging Face directory, loadable by llama-jax and by transformers with the same numbers."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import llama_jax
from llama_jax import CheckpointError, convert_gguf
from llama_jax.quantized import dense
from llama_jax.safetensors_file import SafetensorsFile
from tests.conftest import hf_logits

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def converted(tmp_path_factory, default_path):
    return convert_gguf(default_path, tmp_path_factory.mktemp("smollm2-f32"))


def test_converted_directory_loads_with_the_same_weights(model, converted):
    again = llama_jax.load(converted)
    assert again.config == model.config
    assert again.eos_ids == model.eos_ids
    assert again.chat_template == model.chat_template
    for (name, a), (_, b) in zip(again.weights.hf_tensors(), model.weights.hf_tensors(), strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_transformers_loads_the_converted_directory(model, hf_model, converted, prompt_ids):
    """transformers reads the directory (weights, config, tokenizer, chat template) to the same model it builds
    from the GGUF file itself."""
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32, attn_implementation="eager").eval()
    reference = hf_model.state_dict()
    for name, tensor in hf.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), reference[name].numpy(), err_msg=name)
    ids = prompt_ids[0]
    assert np.abs(hf_logits(hf, ids) - model.logits(ids)).max() < 1e-3
    tok = AutoTokenizer.from_pretrained(converted)
    text = "Héllo 🙂, 12345 <|im_start|>user"
    assert tok.encode(text) == model.tokenizer.encode(text)
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_bf16_conversion_rounds_each_weight_once(model, default_path, tmp_path):
    out = convert_gguf(default_path, tmp_path / "bf16", dtype="bfloat16")
    f = SafetensorsFile(out / "model.safetensors")
    emb = f.read("model.embed_tokens.weight")
    assert emb.dtype == np.dtype(ml_dtypes.bfloat16)
    expected = np.asarray(dense(model.weights.emb)).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(emb, expected)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    bf16 = llama_jax.load(out, dtype="bfloat16")
    assert set(bf16.weights.held()) == {"bfloat16"}
    assert bf16.generate("The capital of France is", max_new_tokens=5)


def test_convert_refuses_to_overwrite_a_checkpoint(default_path, converted):
    with pytest.raises(CheckpointError, match=r"already holds model\.safetensors"):
        convert_gguf(default_path, converted)
