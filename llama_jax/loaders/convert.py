"""GGUF → Hugging Face directory: model.safetensors (f32 or bf16), config.json, generation_config.json,
tokenizer.json, tokenizer_config.json and special_tokens_map.json, loadable by llama-jax and by transformers.

Everything transformers reads from the GGUF file itself is written where it reads it from a directory: the
sizes, RoPE base, norm epsilon and context length (config.json), the special token ids (config.json's
bos/eos/pad/unk_token_id; tokenizer_config.json's bos/eos/unk/pad_token, add_bos_token and add_eos_token), the
chat template, and the stop ids (generation_config.json), so that both read the same model and tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from llama_jax.core.weights import DTYPES
from llama_jax.errors import CheckpointError, ConfigError, UnsupportedDTypeError
from llama_jax.loaders.checkpoint import Checkpoint, load_checkpoint

_WRITTEN = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


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
        write_checkpoint(ck, out_dir, dtype)
    except OSError as e:
        raise CheckpointError(f"{out_dir}: could not write the checkpoint ({e.strerror or e})") from e
    return out_dir


def write_checkpoint(ck: Checkpoint, out_dir: Path, dtype: str) -> None:
    """A checkpoint's files in out_dir (created if needed), its weights in dtype (float32 or bfloat16); OSError
    where the disk refuses them."""
    target = DTYPES[dtype]
    try:
        hf_config = ck.config.to_hf()  # before any file is written
    except ConfigError as e:
        raise ConfigError(f"{ck.source}: {e}; load the file itself instead of converting it") from e
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {name: np.ascontiguousarray(array.astype(target)) for name, array in ck.weights.hf_tensors()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    tok, special = ck.tokenizer, ck.special
    eos = list(ck.eos_ids)
    token_ids = {f"{name}_token_id": i for name, i in special.ids().items() if i is not None}
    hf_config |= token_ids | {"torch_dtype": str(target)}
    hf_config["eos_token_id"] = eos[0] if len(eos) == 1 else eos or None  # the stop ids, as the GGUF loader has them
    _write_json(out_dir / "config.json", hf_config)
    generation = {key: hf_config[key] for key in ("bos_token_id", "pad_token_id") if key in hf_config}
    _write_json(out_dir / "generation_config.json", generation | {"eos_token_id": eos})
    tok.save(out_dir / "tokenizer.json")
    tokens = special.tokenizer_config(tok)
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": ck.config.context}
    _write_json(out_dir / "tokenizer_config.json", tok_config | tokens | {"chat_template": ck.chat_template})
    _write_json(out_dir / "special_tokens_map.json", {k: v for k, v in tokens.items() if k.endswith("_token") and v})


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
