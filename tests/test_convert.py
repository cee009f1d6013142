"""convert: GGUF → Hugging Face directory, loadable by llama-jax and by transformers with the same numbers."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

import llama_jax
from llama_jax import CheckpointError, convert_gguf
from llama_jax.core.quantized import dense
from llama_jax.loaders.safetensors_file import SafetensorsFile
from tests.helpers import hf_logits

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


def assert_same_tokenizer_and_config(gguf_path, converted, texts) -> None:
    """transformers reads the converted directory to the tokenizer and config it builds from the GGUF file itself:
    the special tokens (ids and texts), the add-BOS/EOS flags, the encodings of the texts, the chat template, and
    every config field that describes the model (sizes, RoPE base, norm epsilon, context, token ids)."""
    from transformers import AutoConfig, AutoTokenizer

    from_gguf = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    from_dir = AutoTokenizer.from_pretrained(converted)
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(from_dir, f"{name}_token") == getattr(from_gguf, f"{name}_token"), name
        assert getattr(from_dir, f"{name}_token_id") == getattr(from_gguf, f"{name}_token_id"), name
    assert (from_dir.add_bos_token, from_dir.add_eos_token) == (from_gguf.add_bos_token, from_gguf.add_eos_token)
    assert from_dir.chat_template == from_gguf.chat_template
    for text in texts:
        assert from_dir.encode(text) == from_gguf.encode(text), text
    config_gguf = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).to_dict()
    config_dir = AutoConfig.from_pretrained(converted).to_dict()
    # what only the one source can say: its own name and path, the class and dtype the directory records
    unsaid = {"_name_or_path", "_model_name_or_path", "architectures", "dtype", "transformers_version"}
    keys = (set(config_gguf) | set(config_dir)) - unsaid
    assert {k: (config_gguf.get(k), config_dir.get(k)) for k in keys if config_gguf.get(k) != config_dir.get(k)} == {}


def test_the_converted_directory_keeps_every_special_token_of_the_default_file(default_path, converted):
    """SmolLM2's GGUF names BOS <|im_start|>, EOS and PAD <|im_end|>, UNK <|endoftext|>: the converted directory
    keeps each (a lost BOS made lm-eval score a document's first token after EOS instead of BOS), and llama-jax
    reads the same ones from both."""
    assert_same_tokenizer_and_config(default_path, converted, ["Hello world", "<|im_start|>user\nhi", " 12 ab"])
    from_gguf, from_dir = llama_jax.load_checkpoint(default_path), llama_jax.load_checkpoint(converted)
    assert from_dir.special == from_gguf.special
    assert (from_gguf.special.bos, from_gguf.special.eos, from_gguf.special.unk, from_gguf.special.pad) == (1, 2, 0, 2)


# small GGUF files: the 256 byte tokens, <eos> (256), "Ġt" (257), then <pad0>.. (tests/gguf_builder.py)
SPECIAL_CASES = {
    "eos-only": {},
    "bos-added": {"tokenizer__ggml__bos_token_id": 258, "tokenizer__ggml__add_bos_token": True},
    "bos-not-added-pad-unk": {
        "tokenizer__ggml__bos_token_id": 258,
        "tokenizer__ggml__add_bos_token": False,
        "tokenizer__ggml__padding_token_id": 259,
        "tokenizer__ggml__unknown_token_id": 260,
    },
    "bos-and-eos-added": {
        "tokenizer__ggml__bos_token_id": 258,
        "tokenizer__ggml__add_bos_token": True,
        "tokenizer__ggml__add_eos_token": True,
    },
}


@pytest.mark.parametrize("case", SPECIAL_CASES)
def test_a_small_gguf_converts_with_its_special_tokens(tmp_path, case):
    """GGUF files with and without a BOS token, with the flags that add BOS and EOS to a text, and PAD and UNK:
    transformers reads the converted directory as it reads the file; llama-jax encodes as transformers does from
    either, and keeps the same special tokens."""
    from tests.gguf_builder import write_gguf
    from tests.helpers import hf_from_config

    config = llama_jax.LlamaConfig(kv=1, g=2, half=4, ffn=16, layers=1, vocab=264, context=64)
    tensors = {n: p.detach().numpy() for n, p in hf_from_config(config).state_dict().items()}
    tensors.pop("lm_head.weight", None)
    # the special tokens of this case are control tokens, as llama.cpp's converter marks them
    types = [1] * 256 + [3, 1] + [3] * 6
    path = write_gguf(tmp_path / "tiny.gguf", config, tensors, tokenizer__ggml__token_type=types, **SPECIAL_CASES[case])
    converted = convert_gguf(path, tmp_path / "converted")
    texts = ["a tt", "t<pad0>t", "xyz"]
    assert_same_tokenizer_and_config(path, converted, texts)
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    from_gguf, from_dir = llama_jax.load_checkpoint(path), llama_jax.load_checkpoint(converted)
    assert from_dir.special == from_gguf.special
    assert from_gguf.bos_id == SPECIAL_CASES[case].get("tokenizer__ggml__bos_token_id")
    for text in texts:
        assert from_gguf.tokenizer.encode(text) == from_dir.tokenizer.encode(text) == reference.encode(text), text
