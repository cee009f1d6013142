"""Checkpoint loaders: a Hugging Face directory or a GGUF file → config, weights, tokenizer, chat template.

Hugging Face directory: config.json, model.safetensors (or shards with model.safetensors.index.json),
tokenizer.json, and optionally tokenizer_config.json (chat template) and generation_config.json (stop ids).
GGUF: everything from the one file; llama.cpp's row permutation of the q and k projections is undone so that
RoPE's two halves of a head are where the Hugging Face layout has them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from llama_jax.core import arrays
from llama_jax.core.config import LlamaConfig, read_config_json
from llama_jax.core.quantized import Blocks
from llama_jax.core.weights import Weights
from llama_jax.errors import (
    CheckpointNotFoundError,
    ConfigError,
    ConfigMismatchError,
    CorruptFileError,
    MissingTensorError,
    TensorShapeError,
)
from llama_jax.loaders.gguf_file import GGUFFile
from llama_jax.loaders.safetensors_file import open_safetensors
from llama_jax.loaders.tensors import weights_from_tensors
from llama_jax.text.tokenizer import SpecialTokens, Tokenizer


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint holds. eos_ids: the ids that end a generation (the config's and the generation config's;
    GGUF: the EOS and EOT tokens)."""

    config: LlamaConfig
    weights: Weights
    tokenizer: Tokenizer
    chat_template: str | None
    eos_ids: tuple[int, ...]
    source: Path | str

    @property
    def special(self) -> SpecialTokens:
        """The tokenizer's named special tokens and flags, as transformers' tokenizer has them
        (tokenizer_config.json; GGUF: tokenizer.ggml.*)."""
        return self.tokenizer.special

    @property
    def bos_id(self) -> int | None:
        """The tokenizer's beginning-of-sequence token, None where the checkpoint names none."""
        return self.special.bos


def load_checkpoint(path: str | Path, dtype: str = "float32", progress: bool = False) -> Checkpoint:
    """A Hugging Face checkpoint directory or a .gguf file; dtype "stored", "float32" or "bfloat16" (see Weights);
    progress: a progress bar on stderr while the tensors are read."""
    path = Path(path)
    if path.is_dir():
        return _load_hf_dir(path, dtype, progress)
    if path.is_file():
        return _load_gguf(path, dtype, progress)
    raise CheckpointNotFoundError(
        f"{path}: no such file or directory (expected a checkpoint directory or a .gguf file)"
    )


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of a Hugging Face checkpoint directory (tokenizer.json, tokenizer_config.json) or of a GGUF
    file (a vocabulary-only file included), without reading any weights."""
    path = Path(path)
    if path.is_dir():
        return _hf_tokenizer(path, _tokenizer_config(path))
    if path.is_file():
        return _gguf_tokenizer(GGUFFile(path).metadata, path)
    raise CheckpointNotFoundError(
        f"{path}: no such file or directory (expected a checkpoint directory or a .gguf file)"
    )


# ---- Hugging Face directories ----


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(data, dict):
        raise CorruptFileError(f"{path}: expected a JSON object")
    return data


def _ids(value: Any, source: Path | str, key: str) -> list[int]:
    """A token id or a list of them (config.json's eos_token_id), checked to be integers."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{source}: {key} is {value!r}; expected a token id or a list of token ids")
    return values


def _required(directory: Path, name: str) -> Path:
    if not (directory / name).is_file():
        raise CheckpointNotFoundError(
            f"{directory}: no {name}; a Hugging Face checkpoint directory holds config.json, model.safetensors (or"
            " shards) and tokenizer.json"
        )
    return directory / name


def _tokenizer_config(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer_config.json"
    return _read_json(path) if path.exists() else {}


def _hf_tokenizer(directory: Path, tok_config: dict[str, Any]) -> Tokenizer:
    """tokenizer.json with the special tokens tok_config (the directory's tokenizer_config.json, read once) names."""
    tokenizer_json = _required(directory, "tokenizer.json")
    return Tokenizer.from_files(tokenizer_json, tok_config, str(directory / "tokenizer_config.json"))


def _load_hf_dir(directory: Path, dtype: str, progress: bool) -> Checkpoint:
    _required(directory, "config.json")
    _required(directory, "tokenizer.json")
    hf_config = read_config_json(directory / "config.json")  # read once: the sizes, and the stop ids below
    config = LlamaConfig.from_hf(hf_config, source=str(directory / "config.json"))
    getters, file_names = unfused(config, open_safetensors(directory))
    _layer_count_checked(config, len(getters), directory)
    tok_config = _tokenizer_config(directory)  # read once: the special tokens, the chat template, the stop ids
    with ThreadPoolExecutor(1) as pool:  # the tokenizer parses while the weights are read (reads free the GIL)
        tokenizer_future = pool.submit(_hf_tokenizer, directory, tok_config)
        weights = weights_from_tensors(config, getters, str(directory), dtype, file_names, progress)
        tokenizer = tokenizer_future.result()
    gen_config = (
        _read_json(directory / "generation_config.json") if (directory / "generation_config.json").exists() else {}
    )
    eos = _ids(hf_config.get("eos_token_id"), directory / "config.json", "eos_token_id")
    eos += _ids(gen_config.get("eos_token_id"), directory / "generation_config.json", "eos_token_id")
    if not eos and isinstance(tok_config.get("eos_token"), str):
        eos = _ids(tokenizer.token_id(tok_config["eos_token"]), directory / "tokenizer_config.json", "eos_token")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    eos_ids = tuple(dict.fromkeys(eos))
    return _checked(Checkpoint(config, weights, tokenizer, template, eos_ids, directory))


# ---- GGUF files ----

_GGUF_TO_HF = {spec.gguf: spec.hf for spec in arrays.MODEL.values()}  # "token_embd.weight": "model.embed_..."
_GGUF_LAYER_PARTS = {  # "attn_q": "self_attn.q_proj", ...: the middle of a layer tensor's names
    spec.gguf.split(".")[2]: spec.hf.removeprefix("model.layers.{}.").rpartition(".")[0]
    for spec in arrays.LAYER.values()
}


_LAYER_PREFIX = arrays.LAYER.q.hf.split("{}")[0]  # "model.layers."
_LAYER_FIELDS = {spec.hf.split("{}")[1]: field for field, spec in arrays.LAYER.items()}  # ".mlp.up_proj.weight": "up"


def layer_field(hf: str) -> str | None:
    """The LayerWeights field a layer tensor's Hugging Face name holds (None for another name), read from the name
    alone: never by listing a config's layers (a file may claim billions)."""
    number, dot, tail = hf.removeprefix(_LAYER_PREFIX).partition(".")
    if not hf.startswith(_LAYER_PREFIX) or not number.isdigit() or not dot:
        return None
    return _LAYER_FIELDS.get(f".{tail}")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor name (unknown names are kept, and refused later as unexpected)."""
    if gguf_name in _GGUF_TO_HF:
        return _GGUF_TO_HF[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER_PARTS:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_PARTS[parts[2]]}.{parts[3]}"
    return gguf_name


def _gguf_names(config: LlamaConfig) -> dict[str, str]:
    """Every GGUF tensor name a model of this config has, by itself → its Hugging Face name."""
    arrays_ = arrays.checkpoint_arrays(config).items()
    return {spec.gguf if layer is None else spec.gguf.format(layer): hf for hf, (_, spec, layer) in arrays_}


def _fused_hf_name(gguf_name: str, config: LlamaConfig) -> str | None:
    """The Hugging Face name of a fused GGUF tensor of a family that fuses (`arrays.FUSED`), else None."""
    parts = gguf_name.split(".")
    if config.family not in arrays.FUSED_FAMILIES or len(parts) != 4 or not parts[1].isdigit():
        return None
    for hf, gguf_pattern, _ in arrays.FUSED:
        if gguf_name == gguf_pattern.format(parts[1]):
            return hf.format(parts[1])
    return None


def unfused(config: LlamaConfig, getters: dict[str, Callable[[], Any]]) -> tuple[dict[str, Callable[[], Any]], dict]:
    """A checkpoint's tensor reads with each fused tensor (`arrays.FUSED`, in a family that fuses) replaced by reads
    of its parts' rows under their own names, and, for the errors, each part's fused tensor and rows: ({name:
    read}, {part: (fused name, "rows a:b")}). A part's read reads the fused tensor again (a GGUF's: a view of the
    file) and keeps its rows only, so no layer's fused tensor is held while the layers' parts are stacked."""
    if config.family not in arrays.FUSED_FAMILIES:
        return getters, {}
    out, whence = dict(getters), {}
    for i in range(config.layers):
        for hf, _, fields in arrays.FUSED:
            name = hf.format(i)
            if name not in out:
                continue
            rows = [arrays.LAYER[f].checkpoint_shape(config)[0] for f in fields]

            def part(k: int, read: Callable[[], Any], rows=rows, name=name):
                tensor, start = read(), sum(rows[:k])
                if tensor.shape[0] != sum(rows):
                    raise TensorShapeError(
                        f"tensor {name} has {tensor.shape[0]} rows, but the config gives {sum(rows)}: its parts' {rows}"
                    )
                if isinstance(tensor, Blocks):
                    return type(tensor)(tensor.blocks[start : start + rows[k]])
                return tensor[start : start + rows[k]]

            read = out.pop(name)
            for k, field in enumerate(fields):
                part_name = arrays.LAYER[field].hf.format(i)
                out[part_name] = functools.partial(part, k, read)
                whence[part_name] = (name, f"rows {sum(rows[:k])}:{sum(rows[: k + 1])}")
    return out, whence


# the GGUF architectures whose q and k rows (and their biases) llama.cpp's converter permutes: those it runs with
# its interleaved RoPE (LLAMA_ROPE_TYPE_NORM); qwen2 and qwen3 run the rotate-half RoPE (NEOX) on Hugging Face's rows
GGUF_PERMUTED = ("llama", "mistral", "smollm3", "granite")


def unpermute_rows(w: np.ndarray | Blocks, n_heads: int) -> np.ndarray | Blocks:
    """Undoes llama.cpp's convert permutation of a q or k projection [n_heads·head, in] (values or blocks: a row's
    blocks move with it): within each head, llama.cpp interleaves the two halves (row pairs), Hugging Face keeps
    them as two blocks (rotate_half's layout)."""
    if isinstance(w, Blocks):
        return type(w)(unpermute_rows(w.blocks, n_heads))
    out, rest = w.shape[0], w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: Path, dtype: str, progress: bool) -> Checkpoint:
    f = GGUFFile(path)
    meta = f.metadata
    rope_freqs = f.read(arrays.ROPE_FREQS) if arrays.ROPE_FREQS in f.tensors else None
    factors = tuple(f.read(name) for name in arrays.ROPE_FACTORS if name in f.tensors) or None
    if factors is not None and len(factors) != 2:
        raise MissingTensorError(
            f"{path}: a longrope file holds both {' and '.join(arrays.ROPE_FACTORS)}; one is missing"
        )
    tied = arrays.MODEL.lm_head.gguf not in f.tensors
    biases = tuple(m for m in arrays.LAYER_MATRICES if arrays.LAYER[f"{m}_bias"].gguf.format(0) in f.tensors)
    config = LlamaConfig.from_gguf(meta, tied, str(path), rope_freqs, biases, factors)
    permuted = {"q": config.heads, "k": config.kv, "q_bias": config.heads, "k_bias": config.kv}
    permuted = permuted if config.family in GGUF_PERMUTED else {}

    def getter(name: str):
        field = layer_field(hf_name(name))
        heads = permuted.get(field)  # llama.cpp permuted their rows
        if heads is None:
            return lambda: f.read_stored(name)
        shape = (heads * config.head_dim, config.dim) if field in ("q", "k") else (heads * config.head_dim,)

        def read() -> np.ndarray | Blocks:  # a shape the config does not give is left as is, for Weights to refuse
            w = f.read_stored(name)
            return unpermute_rows(w, heads) if w.shape == shape else w

        return read

    read_into_config = (arrays.ROPE_FREQS, *arrays.ROPE_FACTORS)
    names = {name: _fused_hf_name(name, config) or hf_name(name) for name in f.tensors if name not in read_into_config}
    getters, fused_names = unfused(config, {hf: getter(name) for name, hf in names.items()})
    _layer_count_checked(config, len(getters), path)
    file_names = {hf: name for name, hf in names.items()} | {hf: gg for gg, hf in _gguf_names(config).items()}
    file_names |= {part: f"{file_names.get(whole, whole)} {rows}" for part, (whole, rows) in fused_names.items()}
    with ThreadPoolExecutor(1) as pool:  # the tokenizer is built while the weights are read
        tokenizer_future = pool.submit(_gguf_tokenizer, meta, path)
        weights = weights_from_tensors(config, getters, str(path), dtype, file_names, progress)
        tokenizer = tokenizer_future.result()
    eos_keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
    eos = [i for key in eos_keys for i in _ids(meta.get(key), path, key)]
    template = meta.get("tokenizer.chat_template")
    return _checked(Checkpoint(config, weights, tokenizer, template, tuple(eos), path))


_TOKENIZER_LISTS = {
    "tokenizer.ggml.tokens": (str,),
    "tokenizer.ggml.merges": (str,),
    "tokenizer.ggml.token_type": (int,),
    "tokenizer.ggml.scores": (float, int),
}


def _gguf_tokenizer(meta: dict[str, Any], path: Path) -> Tokenizer:
    """Tokenizer.from_gguf, once the tokenizer lists are lists of the right items, its library's errors (plain
    Exceptions, e.g. a merge of a token the vocabulary lacks) as CorruptFileError: both found by fuzzing."""
    for key, items in _TOKENIZER_LISTS.items():
        value = meta.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, items) for v in value):
            kinds = " or ".join(item.__name__ for item in items)
            raise CorruptFileError(
                f"{path}: metadata {key!r} is not a list of {kinds} values ({str(value)[:60]}); the file is corrupt"
            )
    try:
        return Tokenizer.from_gguf(meta, str(path))
    except Exception as e:
        if type(e) is not Exception:  # only the tokenizers library's own errors, not a bug of ours
            raise
        raise CorruptFileError(f"{path}: the tokenizer metadata does not make a tokenizer ({e})") from e


def _layer_count_checked(config: LlamaConfig, n_tensors: int, source: Path) -> None:
    """Refuses a config of more layers than the checkpoint has tensors at all, before its tensors are listed (a layer
    count of 2**31 would list 19 billion names: a hang the fuzz found); a smaller excess is listed by Weights."""
    if config.layers > n_tensors:
        raise MissingTensorError(
            f"{source}: the config gives {config.layers} layers of"
            f" {sum(spec.present(config) for spec in arrays.LAYER.values())} tensors each, but the"
            f" checkpoint holds {n_tensors} tensors in all: most layers are missing (do the config and the weights"
            " belong together?)"
        )


def _checked(ck: Checkpoint) -> Checkpoint:
    """Refuses a tokenizer or stop ids the weights cannot serve."""
    vocab = ck.config.vocab
    if ck.tokenizer.vocab_size > vocab:
        raise ConfigMismatchError(
            f"{ck.source}: the tokenizer has {ck.tokenizer.vocab_size} tokens but the model's vocabulary has {vocab}"
        )
    bad = [i for i in ck.eos_ids if not 0 <= i < vocab]
    if bad:
        raise ConfigMismatchError(f"{ck.source}: end-of-sequence id {bad[0]} is outside the vocabulary [0, {vocab})")
    for name, token in ck.special.ids().items():
        if token is not None and not 0 <= token < vocab:
            raise ConfigMismatchError(f"{ck.source}: the tokenizer's {name} token id {token} is outside [0, {vocab})")
    return ck
