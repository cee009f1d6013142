"""GGUF → Hugging Face directory: model.safetensors (f32 or bf16), config.json, generation_config.json,
tokenizer.json and tokenizer_config.json (with the chat template), loadable by llama-jax and by transformers."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from llama_jax.checkpoint import Checkpoint, load_checkpoint
from llama_jax.errors import CheckpointError, UnsupportedDTypeError
from llama_jax.weights import DTYPES

_WRITTEN = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def convert_gguf(
    source: str | Path, out_dir: str | Path, dtype: str = "float32", overwrite: bool = False, progress: bool = False
) -> Path:
    """Writes the GGUF file `source` as a Hugging Face checkpoint directory `out_dir` (created if needed); refuses
    to replace an existing checkpoint there unless overwrite. progress: a progress bar while reading. Returns
    out_dir."""
    source, out_dir = Path(source), Path(out_dir)
    if dtype not in DTYPES:
        raise UnsupportedDTypeError(f"convert: dtype {dtype!r} is not offered; choose one of {sorted(DTYPES)}")
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"{out_dir}: exists and is not a directory; choose a directory to write the checkpoint")
    existing = [name for name in _WRITTEN if (out_dir / name).exists()]
    if existing and not overwrite:
        raise CheckpointError(f"{out_dir}: already holds {', '.join(existing)}; choose another directory or overwrite")
    ck = load_checkpoint(source, dtype="float32", progress=progress)
    try:
        _write(ck, out_dir, DTYPES[dtype])
    except OSError as e:
        raise CheckpointError(f"{out_dir}: could not write the checkpoint ({e.strerror or e})") from e
    return out_dir


def _write(ck: Checkpoint, out_dir: Path, target: np.dtype) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: np.ascontiguousarray(array.astype(target)) for name, array in ck.weights.hf_tensors()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    tok = ck.tokenizer
    eos = list(ck.eos_ids)
    hf_config = ck.config.to_hf() | {"torch_dtype": str(target), "eos_token_id": eos[0] if len(eos) == 1 else eos}
    (out_dir / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}, indent=2) + "\n")
    tok.save(out_dir / "tokenizer.json")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": ck.config.context,
        "eos_token": tok.backend.id_to_token(eos[0]) if eos else None,
        "chat_template": ck.chat_template,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
