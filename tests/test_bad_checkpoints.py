"""Every kind of bad checkpoint gets a clear error: the specific subclass of `LlamaJaxError`, with a message that names
the file (or directory) and the problem; never a bare KeyError, struct.error, ValueError, a hang or a crash.

The checkpoints are built here from real files in tmp_path: a tiny Hugging Face directory (config.json,
model.safetensors or two shards with their index, tokenizer.json) and a tiny GGUF file written by gguf.GGUFWriter;
each test breaks one thing. Two tests cut the real SmolLM2 GGUF file."""

from __future__ import annotations

import contextlib
import json
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import quants
from safetensors.numpy import save_file

import llama_jax
from llama_jax import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    ConfigMismatchError,
    CorruptFileError,
    DefaultModelMissingError,
    LlamaJaxError,
    MissingTensorError,
    NonFiniteTensorError,
    TensorShapeError,
    TensorSpanError,
    TruncatedFileError,
    UnexpectedTensorError,
    UnsupportedDTypeError,
)
from llama_jax.loaders.safetensors_file import SafetensorsFile
from llama_jax.testing import byte_tokenizer, random_tensors, tiny_config
from tests import gguf_builder
from tests.gguf_builder import GGUF_NAME, gguf_metadata

CONFIG = tiny_config()  # dim 32, kvw 16, ffn 24, 2 layers, vocab 260, tied
SHARD_1, SHARD_2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"
Q = gguf.GGMLQuantizationType


@contextlib.contextmanager
def refused(cls: type[Exception], match: str, where: Path | str) -> Iterator[pytest.ExceptionInfo]:
    """pytest.raises for exactly `cls` (not a subclass of it), whose message matches `match` and names `where`."""
    with pytest.raises(cls, match=match) as info:
        yield info
    assert info.type is cls, f"{info.type.__name__}, not {cls.__name__}: {info.value}"
    assert str(where) in str(info.value), f"the message does not name {where}: {info.value}"


# ---- builders: a Hugging Face directory ----


def write_hf_dir(
    directory: Path,
    tensors: dict[str, np.ndarray] | None = None,
    hf_config: dict[str, Any] | None = None,
    tokenizer_specials: tuple[str, ...] = ("<eos>",),
) -> Path:
    """config.json, model.safetensors and tokenizer.json of CONFIG (or of the given tensors / config dict)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG.to_hf() if hf_config is None else hf_config))
    save_file(random_tensors(CONFIG) if tensors is None else tensors, str(directory / "model.safetensors"))
    byte_tokenizer(tokenizer_specials).save(directory / "tokenizer.json")
    return directory


def write_sharded_dir(directory: Path) -> Path:
    """The same checkpoint in two shards (the embedding and layer 0; the rest) with model.safetensors.index.json."""
    write_hf_dir(directory)
    (directory / "model.safetensors").unlink()
    tensors = random_tensors(CONFIG)
    first = {n: a for n, a in tensors.items() if n.startswith(("model.embed_tokens.", "model.layers.0."))}
    second = {n: a for n, a in tensors.items() if n not in first}
    save_file(first, str(directory / SHARD_1))
    save_file(second, str(directory / SHARD_2))
    weight_map = {n: SHARD_1 for n in first} | {n: SHARD_2 for n in second}
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return directory


def raw_safetensors(header: Any, data: bytes = b"") -> bytes:
    """A safetensors file by hand: u64 little-endian header length, the header JSON, the data."""
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


# ---- builders: a GGUF file ----


def write_gguf(
    path: Path,
    tensors: dict[str, np.ndarray | tuple[np.ndarray, gguf.GGMLQuantizationType]] | None = None,
    arch: str = "llama",
    **meta: Any,
) -> Path:
    """A GGUF file of CONFIG's random tensors (F32, by GGUF name), or of the given ones (an array, or quantized bytes
    and their GGML type); metadata keys as in gguf_metadata, changed by `meta` (dots as "__"; None drops a key)."""
    metadata = gguf_metadata(CONFIG) | {key.replace("__", "."): value for key, value in meta.items()}
    if tensors is None:
        tensors = {GGUF_NAME[name]: array for name, array in random_tensors(CONFIG).items()}
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        if value is None:
            continue
        vtype = gguf.GGUFValueType.UINT32 if type(value) is int else gguf.GGUFValueType.get_type(value)
        writer.add_key_value(key, value, vtype)
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def field_offset(data: bytes, name: str) -> int:
    """The byte just after the first occurrence of the string `name` in a GGUF file (a key or a tensor name)."""
    return data.index(name.encode()) + len(name)


def patched(data: bytes, offset: int, raw: bytes) -> bytes:
    return data[:offset] + raw + data[offset + len(raw) :]


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    return write_hf_dir(tmp_path / "ckpt")


@pytest.fixture
def sharded_dir(tmp_path: Path) -> Path:
    return write_sharded_dir(tmp_path / "sharded")


@pytest.fixture
def gguf_path(tmp_path: Path) -> Path:
    return write_gguf(tmp_path / "tiny.gguf")


# ---- the error classes ----


@pytest.mark.parametrize(
    "cls",
    [
        ConfigError,
        CheckpointError,
        CheckpointNotFoundError,
        DefaultModelMissingError,
        CorruptFileError,
        TruncatedFileError,
        TensorSpanError,
        MissingTensorError,
        UnexpectedTensorError,
        TensorShapeError,
        ConfigMismatchError,
        UnsupportedDTypeError,
        NonFiniteTensorError,
    ],
)
def test_every_error_class_is_a_llama_jax_error(cls):
    """Catching LlamaJaxError catches every error a bad checkpoint raises; the file errors are CheckpointErrors."""
    assert issubclass(cls, LlamaJaxError)
    assert cls is ConfigError or issubclass(cls, CheckpointError)
    assert getattr(llama_jax, cls.__name__) is cls


# ---- baselines: the valid tiny checkpoints load ----


def test_valid_hf_directory_loads(hf_dir):
    """The unbroken tiny directory loads with its config and tensors, so each failure below is the one break."""
    ck = llama_jax.load_checkpoint(hf_dir)
    assert ck.config == CONFIG
    np.testing.assert_array_equal(np.asarray(ck.weights.emb), random_tensors(CONFIG)["model.embed_tokens.weight"])
    assert ck.tokenizer.vocab_size == 257


def test_valid_sharded_directory_loads(sharded_dir):
    """The unbroken sharded directory loads, each tensor from the shard its index names."""
    ck = llama_jax.load_checkpoint(sharded_dir)
    tensors = random_tensors(CONFIG)
    np.testing.assert_array_equal(np.asarray(ck.weights.lnf), tensors["model.norm.weight"])
    np.testing.assert_array_equal(np.asarray(ck.weights.layers.up[1]), tensors["model.layers.1.mlp.up_proj.weight"])


def test_valid_gguf_loads(gguf_path):
    """The unbroken tiny GGUF file loads: config from the metadata, F32 tensors, the tokenizer and its eos id."""
    ck = llama_jax.load_checkpoint(gguf_path)
    assert ck.config == CONFIG
    assert ck.eos_ids == (256,)
    assert ck.tokenizer.vocab_size == CONFIG.vocab
    np.testing.assert_array_equal(np.asarray(ck.weights.emb), random_tensors(CONFIG)["model.embed_tokens.weight"])


# ---- safetensors: truncated and corrupt files ----


@pytest.mark.parametrize(
    ("cut", "cls", "match"),
    [
        ("data", TensorSpanError, "past the end of the file"),
        ("header", TruncatedFileError, "the header claims .* bytes but the file has only"),
        ("5 bytes", TruncatedFileError, "5 bytes, too short for a safetensors header"),
        ("empty", TruncatedFileError, "0 bytes, too short for a safetensors header"),
    ],
)
def test_truncated_safetensors(hf_dir, cut, cls, match):
    """A model.safetensors cut in its data, in its header or before its 8-byte length is refused as truncated."""
    path = hf_dir / "model.safetensors"
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    keep = {"data": len(data) - 100, "header": 8 + header_len // 2, "5 bytes": 5, "empty": 0}[cut]
    path.write_bytes(data[:keep])
    with refused(cls, match, path):
        llama_jax.load_checkpoint(hf_dir)


@pytest.mark.parametrize("garbage", [b"#####", b"\xff\xfe\xfd\xfc"], ids=["not-json", "not-utf8"])
def test_corrupt_safetensors_header(hf_dir, garbage):
    """Bytes overwritten inside the JSON header (not JSON, or not even UTF-8) give CorruptFileError."""
    path = hf_dir / "model.safetensors"
    path.write_bytes(patched(path.read_bytes(), 8, garbage))  # over the opening brace
    with refused(CorruptFileError, "the header is not valid JSON", path):
        llama_jax.load_checkpoint(hf_dir)


@pytest.mark.parametrize("length", [2**40, 2**64 - 1])
def test_absurd_safetensors_header_length(hf_dir, length):
    """A header length field larger than the file is refused before anything is allocated or read."""
    path = hf_dir / "model.safetensors"
    path.write_bytes(patched(path.read_bytes(), 0, struct.pack("<Q", length)))
    with refused(TruncatedFileError, f"the header claims {length} bytes", path):
        llama_jax.load_checkpoint(hf_dir)


F32_2 = {"dtype": "F32", "shape": [2]}


@pytest.mark.parametrize(
    ("header", "data", "cls", "match"),
    [
        ({"t": F32_2 | {"data_offsets": [0, 8]}}, b"\0" * 4, TensorSpanError, "'t' occupies bytes .*past the end"),
        ({"t": F32_2 | {"data_offsets": [0, 4]}}, b"\0" * 8, CorruptFileError, "needs 8 bytes but its offsets span 4"),
        ({"t": F32_2 | {"data_offsets": [8, 0]}}, b"\0" * 8, CorruptFileError, r"'t' has shape \(2,\) and offsets"),
        ({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"", CorruptFileError, "offsets"),
        ({"t": F32_2}, b"\0" * 8, CorruptFileError, "header entry of tensor 't' is malformed"),
        ({"t": "F32"}, b"\0" * 8, CorruptFileError, "header entry of tensor 't' is malformed"),
        ([1, 2], b"", CorruptFileError, "the header is not a JSON object"),
        ({"t": {"dtype": "F17", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, UnsupportedDTypeError, "'F17'"),
    ],
    ids=[
        "span-past-end",
        "span-inconsistent-with-shape",
        "begin-after-end",
        "negative-dimension",
        "no-offsets",
        "entry-not-object",
        "header-not-object",
        "unknown-dtype",
    ],
)
def test_hand_built_safetensors_header(hf_dir, header, data, cls, match):
    """A header written by hand whose entries lie about the data (spans past the end of the file, spans that do not
    fit the shape, malformed entries, an unknown dtype) is refused while the header is read."""
    path = hf_dir / "model.safetensors"
    path.write_bytes(raw_safetensors(header, data))
    with refused(cls, match, path):
        llama_jax.load_checkpoint(hf_dir)


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}], ids=["list", "object"])
def test_safetensors_header_with_non_string_dtype(hf_dir, dtype):
    """A header entry whose dtype is not a string is a malformed entry (CorruptFileError), like a missing field."""
    path = hf_dir / "model.safetensors"
    path.write_bytes(raw_safetensors({"t": {"dtype": dtype, "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4))
    with refused(CorruptFileError, "not a name", path):
        llama_jax.load_checkpoint(hf_dir)


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        (
            {"a": F32_2 | {"data_offsets": [0, 8]}, "b": F32_2 | {"data_offsets": [12, 20]}},
            b"\0" * 20,
            r"tensor 'b' occupies bytes \d+\.\.\d+, but bytes \d+\.\.\d+ after tensor 'a' belong to no tensor",
        ),
        (
            {"a": F32_2 | {"data_offsets": [4, 12]}},
            b"\0" * 12,
            r"tensor 'a' occupies bytes \d+\.\.\d+, but bytes \d+\.\.\d+ at the start of the data belong to no tensor",
        ),
        (
            {"b": F32_2 | {"data_offsets": [4, 12]}, "a": F32_2 | {"data_offsets": [0, 8]}},
            b"\0" * 12,
            r"tensor 'b' occupies bytes \d+\.\.\d+, but it overlaps tensor 'a', which ends at byte",
        ),
        (
            {"a": F32_2 | {"data_offsets": [0, 8]}, "b": F32_2 | {"data_offsets": [0, 8]}},
            b"\0" * 8,
            r"tensor 'b' occupies bytes \d+\.\.\d+, but it overlaps tensor 'a'",
        ),
        (
            {"a": F32_2 | {"data_offsets": [0, 8]}},
            b"\0" * 12,
            r"the last tensor, 'a', ends at byte \d+, .* 4 more bytes",
        ),
        ({}, b"\0" * 4, r"the header \(it names no tensor\) ends at byte \d+, .* 4 more bytes"),
    ],
    ids=["gap", "gap-at-start", "overlap", "same-span", "bytes-left-over", "no-tensor-but-data"],
)
def test_safetensors_tensors_not_tiling_the_data(hf_dir, header, data, match):
    """As the safetensors library requires, the tensors' spans tile the data region exactly: a gap, an overlap or
    bytes after the last tensor are TensorSpanError naming the tensor (the library refuses each of these files)."""
    path = hf_dir / "model.safetensors"
    path.write_bytes(raw_safetensors(header, data))
    with refused(TensorSpanError, match, path):
        llama_jax.load_checkpoint(hf_dir)


def test_safetensors_tiling_in_any_header_order_loads(hf_dir):
    """The tiling is checked in the order of the spans, not of the header's keys, and a zero-size tensor at a
    boundary is allowed: the library accepts this file, and so does the reader."""
    header = {
        "b": F32_2 | {"data_offsets": [8, 16]},
        "a": F32_2 | {"data_offsets": [0, 8]},
        "z": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]},
    }
    path = hf_dir / "model.safetensors"
    path.write_bytes(raw_safetensors(header, np.arange(4, dtype="<f4").tobytes()))
    f = SafetensorsFile(path)
    np.testing.assert_array_equal(f.read("b"), [2.0, 3.0])
    assert f.read("z").shape == (0,)


@pytest.mark.parametrize(
    "entry",
    [
        {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]},
        {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]},
        {"dtype": "F32", "shape": [2], "data_offsets": [0, 8.0]},
        {"dtype": "F32", "shape": [True, 2], "data_offsets": [0, 8]},
    ],
    ids=["float-dim", "string-dim", "float-offset", "bool-dim"],
)
def test_safetensors_header_numbers_that_are_not_integers(hf_dir, entry):
    """Shapes and offsets are JSON integers, as the library reads them (usize): 2.0, "2" or true is a malformed
    entry, though Python's int() would take each."""
    path = hf_dir / "model.safetensors"
    path.write_bytes(raw_safetensors({"t": entry}, b"\0" * 8))
    with refused(CorruptFileError, "header entry of tensor 't' is malformed", path):
        llama_jax.load_checkpoint(hf_dir)


@pytest.mark.parametrize("off_by", [-1, -3, -7])
def test_safetensors_header_length_too_short(hf_dir, off_by):
    """A header length a few bytes short, over a header padded with spaces (as the library pads it), still leaves
    valid JSON, but every tensor is read from bytes shifted by that much: the bytes left over at the end of the file
    give it away (TensorSpanError naming the last tensor)."""
    path = hf_dir / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    text = data[8 : 8 + n].rstrip(b" ") + b" " * 8  # 8 spaces of padding, whatever the writer left
    path.write_bytes(struct.pack("<Q", len(text) + off_by) + text + data[8 + n :])
    last = max(json.loads(text), key=lambda name: json.loads(text)[name]["data_offsets"][1])
    with refused(TensorSpanError, rf"the last tensor, '{last}', ends .* {-off_by} more bytes .* header length", path):
        llama_jax.load_checkpoint(hf_dir)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("value", "counts"), [(np.nan, "1 NaN and 0 infinite"), (-np.inf, "0 NaN and 1 infinite")])
def test_safetensors_tensor_holding_a_non_finite_value(tmp_path, value, counts, dtype):
    """One NaN or -inf in a stored tensor is NonFiniteTensorError naming the tensor and the index, whether the
    weights load as float32 or as bfloat16 (the exponent-bits test)."""
    tensors = random_tensors(CONFIG)
    name = "model.layers.1.self_attn.o_proj.weight"
    tensors[name][3, 5] = value
    directory = write_hf_dir(tmp_path / "ckpt", tensors)
    match = rf"tensor {re.escape(name)} holds {counts} values \(the first at index \(3, 5\).*the file is corrupt"
    with refused(NonFiniteTensorError, match, directory):
        llama_jax.load_checkpoint(directory, dtype=dtype)


def test_float32_value_that_overflows_bfloat16(tmp_path):
    """3.4e38 is a finite float32 but rounds to inf in bfloat16: it loads as float32, and as bfloat16 it is refused
    as an infinite weight (the check looks at the weights as converted, not only as stored)."""
    tensors = random_tensors(CONFIG)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name][1, 2] = 3.4e38
    directory = write_hf_dir(tmp_path / "ckpt", tensors)
    assert llama_jax.load_checkpoint(directory).weights.layers.up[0, 1, 2] == np.float32(3.4e38)
    match = rf"tensor {re.escape(name)} holds 0 NaN and 1 infinite values \(the first at index \(1, 2\)"
    with refused(NonFiniteTensorError, match, directory):
        llama_jax.load_checkpoint(directory, dtype="bfloat16")


# ---- safetensors: tensors that do not match the config ----


def test_renamed_tensor_is_reported_missing(tmp_path):
    """A tensor saved under another name: the expected name is listed as missing (missing is checked first)."""
    tensors = random_tensors(CONFIG)
    tensors["model.layers.1.mlp.upp_proj.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")
    directory = write_hf_dir(tmp_path / "ckpt", tensors)
    with refused(MissingTensorError, r"1 tensor\(s\) the config requires are missing", directory) as info:
        llama_jax.load_checkpoint(directory)
    assert "model.layers.1.mlp.up_proj.weight" in str(info.value)


@pytest.mark.parametrize("extra", ["model.layers.0.self_attn.q_proj.bias", "model.layers.2.mlp.up_proj.weight"])
def test_extra_tensor_is_reported_unexpected(tmp_path, extra):
    """A tensor the model has no place for (a bias, a layer beyond the config's) is named as unexpected."""
    tensors = random_tensors(CONFIG) | {extra: np.zeros(4, np.float32)}
    directory = write_hf_dir(tmp_path / "ckpt", tensors)
    with refused(UnexpectedTensorError, f"have no place in a Llama model with this config: {extra}", directory):
        llama_jax.load_checkpoint(directory)


def test_tied_checkpoint_with_a_copy_of_the_embedding_loads(tmp_path):
    """A tied checkpoint that also stores lm_head.weight, equal to the embedding, loads (the copy is ignored)."""
    tensors = random_tensors(CONFIG)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    ck = llama_jax.load_checkpoint(write_hf_dir(tmp_path / "ckpt", tensors))
    assert ck.weights.lm_head is None


def test_tied_checkpoint_with_a_different_lm_head(tmp_path):
    """A tied config beside an lm_head.weight that is not the embedding contradicts the weights."""
    tensors = random_tensors(CONFIG)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"] + 1.0
    directory = write_hf_dir(tmp_path / "ckpt", tensors)
    with refused(ConfigMismatchError, "lm_head.weight differs", directory):
        llama_jax.load_checkpoint(directory)


def test_tensor_of_the_wrong_shape(tmp_path):
    """A tensor saved with the wrong shape (transposed) is named with the shape found and the shape expected."""
    tensors = random_tensors(CONFIG)
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = np.ascontiguousarray(tensors[name].T)  # (24, 32) instead of (32, 24)
    directory = write_hf_dir(tmp_path / "ckpt", tensors)
    with refused(TensorShapeError, rf"tensor {name} has shape \(24, 32\), but the config gives \(32, 24\)", directory):
        llama_jax.load_checkpoint(directory)


@pytest.mark.parametrize(("dtype", "stored"), [(np.int32, "I32"), (np.float64, "F64"), (np.int8, "I8")])
def test_unsupported_safetensors_dtype(tmp_path, dtype, stored):
    """A tensor stored as a dtype llama-jax does not read is named with that dtype and the supported ones."""
    tensors = random_tensors(CONFIG)
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(dtype)
    directory = write_hf_dir(tmp_path / "ckpt", tensors)
    path = directory / "model.safetensors"
    with refused(UnsupportedDTypeError, f"'model.norm.weight' is stored as '{stored}'.*supported: F32, F16", path):
        llama_jax.load_checkpoint(directory)


# ---- config.json contradicting the weights or the tokenizer ----


def test_config_with_more_layers_than_the_weights(hf_dir):
    """num_hidden_layers + 1: every tensor of the extra layer is listed as missing."""
    edit_json(hf_dir / "config.json", num_hidden_layers=CONFIG.layers + 1)
    with refused(MissingTensorError, r"9 tensor\(s\) .* missing: model\.layers\.2\.", hf_dir):
        llama_jax.load_checkpoint(hf_dir)


def test_config_with_billions_of_layers(hf_dir, gguf_path):
    """num_hidden_layers (or llama.block_count) of 2**31: refused at once as missing layers, not by listing 19
    billion tensor names (a hang the fuzz found)."""
    edit_json(hf_dir / "config.json", num_hidden_layers=2**31)
    with refused(MissingTensorError, f"the config gives {2**31} layers of 9 tensors each, but the", hf_dir):
        llama_jax.load_checkpoint(hf_dir)
    data = gguf_path.read_bytes()
    gguf_path.write_bytes(patched(data, field_offset(data, "llama.block_count") + 4, struct.pack("<I", 2**31)))
    with refused(MissingTensorError, f"the config gives {2**31} layers", gguf_path):
        llama_jax.load_checkpoint(gguf_path)


@pytest.mark.parametrize(
    ("changes", "tensor", "expected", "found"),
    [
        (
            {"hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 4},
            "model.embed_tokens.weight",
            (260, 64),
            (260, 32),
        ),
        ({"intermediate_size": 48}, "model.layers.0.mlp.gate_proj.weight", (48, 32), (24, 32)),
        ({"vocab_size": 300}, "model.embed_tokens.weight", (300, 32), (260, 32)),
        ({"num_key_value_heads": 1}, "model.layers.0.self_attn.k_proj.weight", (8, 32), (16, 32)),
    ],
    ids=["hidden_size", "intermediate_size", "vocab_size", "num_key_value_heads"],
)
def test_config_sizes_contradicting_the_weights(hf_dir, changes, tensor, expected, found):
    """A config.json whose sizes differ from the weights': the first tensor read of the wrong shape is named."""
    edit_json(hf_dir / "config.json", head_dim=None, **changes)
    match = re.escape(f"tensor {tensor} has shape {found}, but the config gives {expected}")
    with refused(TensorShapeError, match, hf_dir):
        llama_jax.load_checkpoint(hf_dir)


def test_tokenizer_larger_than_the_vocabulary(tmp_path):
    """A tokenizer.json with more tokens than the config's vocab_size: ids the embedding cannot serve."""
    directory = write_hf_dir(tmp_path / "ckpt", tokenizer_specials=tuple(f"<s{i}>" for i in range(6)))
    with refused(ConfigMismatchError, "the tokenizer has 262 tokens but the model's vocabulary has 260", directory):
        llama_jax.load_checkpoint(directory)


@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
def test_eos_id_outside_the_vocabulary(hf_dir, file):
    """An eos_token_id (in config.json or generation_config.json) beyond the vocabulary is refused."""
    if file == "generation_config.json":
        (hf_dir / file).write_text("{}")
    edit_json(hf_dir / file, eos_token_id=999)
    with refused(ConfigMismatchError, r"end-of-sequence id 999 is outside the vocabulary \[0, 260\)", hf_dir):
        llama_jax.load_checkpoint(hf_dir)


# ---- missing files, unreadable JSON, unsupported configs ----


@pytest.mark.parametrize(
    ("missing", "match"),
    [
        ("config.json", "no config.json"),
        ("tokenizer.json", "no tokenizer.json"),
        ("model.safetensors", "no model.safetensors and no model.safetensors.index.json"),
    ],
)
def test_missing_file(hf_dir, missing, match):
    """A directory without one of the files a checkpoint needs names the directory and the file."""
    (hf_dir / missing).unlink()
    with refused(CheckpointNotFoundError, match, hf_dir):
        llama_jax.load_checkpoint(hf_dir)


@pytest.mark.parametrize("name", ["no-such-checkpoint", "no-such-model.gguf"])
def test_nonexistent_path(tmp_path, name):
    """A path that does not exist is CheckpointNotFoundError, for a directory name as for a .gguf name."""
    path = tmp_path / name
    with refused(CheckpointNotFoundError, "no such file or directory", path):
        llama_jax.load_checkpoint(path)


def test_empty_directory(tmp_path):
    """An empty directory is not a checkpoint: the first missing file is named."""
    with refused(CheckpointNotFoundError, "no config.json", tmp_path):
        llama_jax.load_checkpoint(tmp_path)


def test_model_safetensors_that_is_a_directory(hf_dir):
    """A model.safetensors that is a directory is not a weights file: CheckpointNotFoundError, as for GGUF."""
    path = hf_dir / "model.safetensors"
    path.unlink()
    path.mkdir()
    with refused(CheckpointNotFoundError, "directory", path):
        llama_jax.load_checkpoint(hf_dir)


@pytest.mark.parametrize(
    ("file", "cls", "match"),
    [
        ("config.json", ConfigError, "not a readable JSON config"),
        ("tokenizer.json", CorruptFileError, "not a valid tokenizer.json"),
        ("tokenizer_config.json", CorruptFileError, "not a readable JSON file"),
        ("generation_config.json", CorruptFileError, "not a readable JSON file"),
    ],
)
def test_invalid_json_file(hf_dir, file, cls, match):
    """A JSON file of the directory that does not parse is named (config.json's is a ConfigError)."""
    (hf_dir / file).write_text('{"vocab_size": 260,')
    with refused(cls, match, hf_dir / file):
        llama_jax.load_checkpoint(hf_dir)


def test_a_special_token_the_tokenizer_lacks(hf_dir):
    """tokenizer_config.json naming a BOS token that is not in the vocabulary is refused, naming the token (it
    would otherwise be lost, and lm-eval's first token scored after another prefix)."""
    (hf_dir / "tokenizer_config.json").write_text('{"bos_token": "<nope>"}')
    with refused(
        CheckpointError, "bos_token '<nope>' is not a token of the tokenizer", hf_dir / "tokenizer_config.json"
    ):
        llama_jax.load_checkpoint(hf_dir)


def test_config_json_that_is_not_an_object(hf_dir):
    """A config.json holding a JSON list is a ConfigError naming the file."""
    (hf_dir / "config.json").write_text("[1, 2]")
    with refused(ConfigError, "expected a JSON object, found list", hf_dir / "config.json"):
        llama_jax.load_checkpoint(hf_dir)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "RoPE scaling 'llama3' needs the field"),
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "'longrope' needs the field 'original_max_posi"),
        ({"model_type": "mistral", "attention_bias": True}, "'attention_bias' .* a bias of the attention"),
        ({"model_type": "qwen2", "mlp_bias": True}, "'mlp_bias' .* a bias of the MLP"),
        ({"head_dim": 7}, "the head size 7 is not a positive even number"),
        ({"model_type": "mixtral"}, "model_type is 'mixtral'; a mixture of experts"),
        ({"model_type": "olmo"}, "model_type is 'olmo'; llama-jax runs the Llama-architecture families"),
        ({"hidden_act": "gelu"}, "hidden_act is 'gelu'"),
        ({"sliding_window": 4096}, "sliding_window is set for a llama model"),
        ({"final_logit_softcapping": 30.0}, "'final_logit_softcapping' .* softcapping"),
        ({"num_attention_heads": 3, "head_dim": None}, "not a positive multiple of num_key_value_heads"),
    ],
    ids=lambda v: next(iter(v)) if isinstance(v, dict) else None,
)
def test_unsupported_config(hf_dir, changes, match):
    """A config.json with a feature the port does not run (a RoPE scaling it lacks, biases, other head sizes,
    another architecture, another architecture's computing field) or with impossible sizes is a ConfigError
    naming the feature."""
    edit_json(hf_dir / "config.json", **changes)
    with refused(ConfigError, match, hf_dir / "config.json"):
        llama_jax.load_checkpoint(hf_dir)


@pytest.mark.parametrize("field", ["num_hidden_layers", "intermediate_size", "vocab_size"])
def test_config_size_that_is_not_positive(hf_dir, field):
    """A size of 0 in config.json is a ConfigError naming the file and the field."""
    edit_json(hf_dir / "config.json", **{field: 0})
    with refused(ConfigError, "must be a positive integer, got 0", hf_dir / "config.json"):
        llama_jax.load_checkpoint(hf_dir)


@pytest.mark.parametrize(
    "field", ["hidden_size", "num_attention_heads", "intermediate_size", "num_hidden_layers", "vocab_size"]
)
def test_config_missing_a_field(hf_dir, field):
    """A config.json without a size it must have names the field."""
    hf = json.loads((hf_dir / "config.json").read_text())
    del hf[field]
    (hf_dir / "config.json").write_text(json.dumps(hf))
    with refused(ConfigError, f"missing field '{field}'", hf_dir / "config.json"):
        llama_jax.load_checkpoint(hf_dir)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        pytest.param({"hidden_size": "thirty-two"}, "hidden_size"),
        pytest.param({"vocab_size": None}, "vocab_size"),
        pytest.param({"rope_scaling": "linear"}, "rope_scaling"),
        pytest.param({"eos_token_id": "</s>"}, "eos_token_id"),
        pytest.param({"vocab_size": 260.5}, "vocab_size"),
    ],
    ids=["hidden_size-string", "vocab_size-null", "rope_scaling-string", "eos_token_id-string", "vocab_size-fraction"],
)
def test_config_field_of_the_wrong_type(hf_dir, changes, match):
    """A config.json field of the wrong JSON type is a ConfigError naming the field, not a bare Python error."""
    edit_json(hf_dir / "config.json", **changes)
    with refused(ConfigError, match, hf_dir / "config.json"):
        llama_jax.load_checkpoint(hf_dir)


def test_unsupported_dtype_argument(hf_dir, gguf_path):
    """load_checkpoint(..., dtype="float16") is refused by name, for a directory as for a GGUF file."""
    for path in (hf_dir, gguf_path):
        with pytest.raises(UnsupportedDTypeError, match=r"dtype 'float16' is not offered; choose one of") as info:
            llama_jax.load_checkpoint(path, dtype="float16")
        assert info.type is UnsupportedDTypeError
        assert "bfloat16" in str(info.value) and "float32" in str(info.value)


# ---- sharded checkpoints ----


def test_index_naming_a_missing_shard(sharded_dir):
    """An index naming a shard file that is not in the directory names the index and the shard."""
    (sharded_dir / SHARD_2).unlink()
    with refused(CheckpointNotFoundError, f"names shard '{SHARD_2}', which is not in", sharded_dir / INDEX):
        llama_jax.load_checkpoint(sharded_dir)


def test_index_naming_the_wrong_shard(sharded_dir):
    """An index that puts a tensor in a shard that does not hold it names the tensor and the shard."""
    index = json.loads((sharded_dir / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = SHARD_1
    (sharded_dir / INDEX).write_text(json.dumps(index))
    match = f"names {SHARD_1} as the file of tensor 'model.norm.weight', which it does not hold"
    with refused(CorruptFileError, match, sharded_dir / INDEX):
        llama_jax.load_checkpoint(sharded_dir)


def test_shard_holding_a_tensor_the_index_does_not_list(sharded_dir):
    """A shard with a tensor the index leaves out is refused (the index and the shards disagree)."""
    index = json.loads((sharded_dir / INDEX).read_text())
    del index["weight_map"]["model.norm.weight"]
    (sharded_dir / INDEX).write_text(json.dumps(index))
    with refused(CorruptFileError, r"holds tensors the index does not list: \['model.norm.weight'\]", SHARD_2):
        llama_jax.load_checkpoint(sharded_dir)


@pytest.mark.parametrize(
    "text",
    ['{"weight_map": {', '{"metadata": {}}', '{"weight_map": ["model.norm.weight"]}', "[]"],
    ids=["invalid-json", "no-weight_map", "weight_map-list", "not-object"],
)
def test_malformed_index(sharded_dir, text):
    """An index that is not JSON, or has no weight_map object, is CorruptFileError naming the index."""
    (sharded_dir / INDEX).write_text(text)
    with refused(CorruptFileError, "not a valid safetensors index", sharded_dir / INDEX):
        llama_jax.load_checkpoint(sharded_dir)


@pytest.mark.parametrize("shard", [None, 2], ids=["null", "int"])
def test_index_with_a_non_string_shard_name(sharded_dir, shard):
    """A weight_map value that is not a file name is a malformed index, CorruptFileError naming the index."""
    index = json.loads((sharded_dir / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = shard
    (sharded_dir / INDEX).write_text(json.dumps(index))
    with refused(CorruptFileError, "not a valid safetensors index", sharded_dir / INDEX):
        llama_jax.load_checkpoint(sharded_dir)


# ---- GGUF: truncated and corrupt headers ----


@pytest.mark.parametrize(
    ("cut", "cls", "match"),
    [
        ("data", TensorSpanError, r"tensor 'blk\.1\.ffn_down\.weight' .* past the end of the file"),
        ("100 bytes", TruncatedFileError, "the file ends at byte 100, but metadata"),
        ("3 bytes", TruncatedFileError, "the file ends at byte 3, but the magic number"),
        ("empty", TruncatedFileError, "the file ends at byte 0, but the magic number"),
    ],
)
def test_truncated_gguf(gguf_path, cut, cls, match):
    """A GGUF file cut in its data or its header (or empty) is refused naming the byte and the field."""
    data = gguf_path.read_bytes()
    keep = {"data": len(data) - 64, "100 bytes": 100, "3 bytes": 3, "empty": 0}[cut]
    gguf_path.write_bytes(data[:keep])
    with refused(cls, match, gguf_path):
        llama_jax.load_checkpoint(gguf_path)


def _patch_key_type(data: bytes) -> bytes:
    return patched(data, field_offset(data, "general.architecture"), struct.pack("<I", 99))


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        (lambda d: patched(d, 0, b"GGML"), r"not a GGUF file \(starts with b'GGML'"),
        (lambda d: patched(d, 4, struct.pack("<I", 1)), "GGUF version 1 is not supported"),
        (lambda d: patched(d, 4, struct.pack("<I", 99)), "GGUF version 99 is not supported"),
        (lambda d: patched(d, 8, struct.pack("<Q", 2**40)), f"claims {2**40} tensors"),
        (lambda d: patched(d, 16, struct.pack("<Q", 2**40)), f"{2**40} metadata entries, more than a file"),
        (lambda d: patched(d, 32, b"\xff"), "the key of metadata entry 0 at byte 32 is not valid UTF-8"),
        (_patch_key_type, "metadata 'general.architecture' has an unknown value type 99"),
    ],
    ids=["magic", "version-1", "version-99", "tensor-count", "metadata-count", "key-not-utf8", "value-type"],
)
def test_corrupt_gguf_header(gguf_path, patch, match):
    """A bad magic, an unsupported version, absurd counts, a key that is not UTF-8 or an unknown value type are
    CorruptFileError naming the field."""
    gguf_path.write_bytes(patch(gguf_path.read_bytes()))
    with refused(CorruptFileError, match, gguf_path):
        llama_jax.load_checkpoint(gguf_path)


@pytest.mark.parametrize(
    ("field", "match"),
    [
        ("key", "the key of metadata entry 0 needs bytes"),
        ("value", "metadata 'general.architecture' needs bytes"),
        ("array", f"metadata 'tokenizer.ggml.tokens' claims {2**50} items but only"),
    ],
)
def test_huge_gguf_length_field(gguf_path, field, match):
    """A string or array length made huge is refused as truncated, before anything that size is allocated."""
    data = gguf_path.read_bytes()
    offset = {
        "key": 24,  # after magic, version and the two counts: the length of the first key
        "value": field_offset(data, "general.architecture") + 4,  # after the key and its u32 value type
        "array": field_offset(data, "tokenizer.ggml.tokens") + 8,  # after the value type and the item type
    }[field]
    gguf_path.write_bytes(patched(data, offset, struct.pack("<Q", 2**50 if field == "array" else 2**62)))
    with refused(TruncatedFileError, match, gguf_path):
        llama_jax.load_checkpoint(gguf_path)


@pytest.mark.parametrize(
    ("at", "value", "cls", "match"),
    [
        (0, struct.pack("<I", 9), CorruptFileError, "claims 9 dimensions"),
        (4, struct.pack("<Q", 0), CorruptFileError, r"dimensions \[0, 260\], which a F32 tensor cannot have"),
        (4, struct.pack("<Q", 2**40), TensorSpanError, "past the end of the file"),
        (20, struct.pack("<I", 1000), CorruptFileError, "unknown GGML type 1000"),
        (20, struct.pack("<I", Q.Q2_K), CorruptFileError, "which a Q2_K tensor cannot have"),
        (20, struct.pack("<I", Q.Q8_1), UnsupportedDTypeError, "is stored as Q8_1; llama-jax reads F32"),
        (24, struct.pack("<Q", 4), CorruptFileError, "starts at offset 4, not a multiple of 32"),
        (24, struct.pack("<Q", 2**40), TensorSpanError, "past the end of the file"),
    ],
    ids=["n_dims", "zero-dim", "huge-dim", "unknown-type", "q2_k-dims", "q8_1", "misaligned", "offset-past-end"],
)
def test_corrupt_gguf_tensor_info(gguf_path, at, value, cls, match):
    """A tensor info (n_dims u32, dims u64 ×2, type u32, offset u64) with an impossible field names the tensor."""
    data = gguf_path.read_bytes()
    gguf_path.write_bytes(patched(data, field_offset(data, "token_embd.weight") + at, value))
    with refused(cls, match, gguf_path) as info:
        llama_jax.load_checkpoint(gguf_path)
    assert "'token_embd.weight'" in str(info.value)


def _tensor_offset_at(data: bytes, name: str) -> int:
    """Where the u64 data offset of tensor `name`'s info lies (after its name, n_dims, the dims and the type)."""
    at = field_offset(data, name)
    (n_dims,) = struct.unpack("<I", data[at : at + 4])
    return at + 4 + 8 * n_dims + 4


@pytest.mark.parametrize(
    ("tensor", "offset", "match"),
    [
        ("output_norm.weight", 33280 + 32, r"tensor 'output_norm\.weight' starts at data offset 33312, but the tensor"),
        ("output_norm.weight", 0, r"tensor 'output_norm\.weight' starts at data offset 0, but the tensor before it"),
        ("token_embd.weight", 32, r"tensor 'token_embd\.weight' starts at data offset 32, but the first tensor's"),
    ],
    ids=["gap", "overlap", "first-not-at-0"],
)
def test_gguf_tensor_data_not_following_the_previous(gguf_path, tensor, offset, match):
    """As llama.cpp requires, each tensor's data follows the previous tensor's (padded to the alignment) in header
    order: an offset that leaves a gap or overlaps is TensorSpanError naming the tensor (and the one before it)."""
    data = gguf_path.read_bytes()
    at = _tensor_offset_at(data, tensor)
    assert struct.unpack("<Q", data[at : at + 8])[0] == {"token_embd.weight": 0, "output_norm.weight": 33280}[tensor]
    gguf_path.write_bytes(patched(data, at, struct.pack("<Q", offset)))
    with refused(TensorSpanError, match, gguf_path) as info:
        llama_jax.load_checkpoint(gguf_path)
    if tensor == "output_norm.weight":
        assert "'token_embd.weight' (F32, 33280 bytes)" in str(info.value)


@pytest.mark.parametrize("change", ["bytes-appended", "last-tensor-retyped"])
def test_gguf_bytes_after_the_last_tensor(gguf_path, change):
    """Bytes after the last tensor's padded data (appended, or left over when the last tensor's type is changed to a
    smaller one, F32 to F16: its data would be reinterpreted) are TensorSpanError naming the last tensor."""
    data = gguf_path.read_bytes()
    if change == "bytes-appended":
        data += b"\0" * 64
    else:
        data = patched(data, _tensor_offset_at(data, "blk.1.ffn_down.weight") - 4, struct.pack("<I", Q.F16))
    gguf_path.write_bytes(data)
    match = r"bytes after the data of its last tensor, 'blk\.1\.ffn_down\.weight' \(F(32|16), \d+ bytes"
    with refused(TensorSpanError, match, gguf_path):
        llama_jax.load_checkpoint(gguf_path)


@pytest.mark.parametrize(("value", "counts"), [(np.nan, "1 NaN and 0 infinite"), (np.inf, "0 NaN and 1 infinite")])
def test_gguf_f32_tensor_holding_a_non_finite_value(tmp_path, value, counts):
    """A NaN or inf in an F32 tensor of a GGUF file names the tensor by both names (through llama.cpp's q/k row
    permutation, which moves the value)."""
    tensors = {GGUF_NAME[n]: a for n, a in random_tensors(CONFIG).items()}
    tensors["blk.1.attn_k.weight"][2, 7] = value
    path = write_gguf(tmp_path / "nan.gguf", tensors)
    match = rf"model\.layers\.1\.self_attn\.k_proj\.weight \(blk\.1\.attn_k\.weight\) holds {counts} values"
    with refused(NonFiniteTensorError, match, path):
        llama_jax.load_checkpoint(path)


@pytest.mark.parametrize(
    ("ggml_type", "at", "scale"),
    [(Q.Q8_0, 0, np.inf), (Q.Q4_1, 0, -np.inf), (Q.Q4_1, 2, np.inf), (Q.Q4_0, 0, np.nan)],
    ids=["q8_0-d-inf", "q4_1-d-minus-inf", "q4_1-m-inf", "q4_0-d-nan"],
)
def test_gguf_quantized_block_with_a_non_finite_scale(tmp_path, ggml_type, at, scale):
    """A quantized block whose f16 scale d (or Q4_1's minimum m) is inf or NaN dequantizes to non-finite values:
    NonFiniteTensorError naming the tensor by both names (the scales are checked through the values they make)."""
    tensors: dict[str, Any] = {GGUF_NAME[n]: a for n, a in random_tensors(CONFIG).items()}
    blocks = quants.quantize(tensors["blk.0.attn_v.weight"], ggml_type)
    blocks[5, at : at + 2] = np.array([scale], "<f2").view(np.uint8)  # row 5's only block: its d (or m)
    tensors["blk.0.attn_v.weight"] = (blocks, ggml_type)
    path = write_gguf(tmp_path / "scale.gguf", tensors)
    match = r"model\.layers\.0\.self_attn\.v_proj\.weight \(blk\.0\.attn_v\.weight\) holds \d+ NaN and \d+ infinite"
    with refused(NonFiniteTensorError, match + r" values \(the first at index \(5, 0\)", path):
        llama_jax.load_checkpoint(path)


# ---- GGUF: tensors and metadata that do not match ----


def test_gguf_tensor_renamed(tmp_path):
    """A GGUF tensor under a wrong name: the tensor the config requires is reported missing."""
    tensors = {GGUF_NAME[n]: a for n, a in random_tensors(CONFIG).items()}
    tensors["blk.1.ffn_upp.weight"] = tensors.pop("blk.1.ffn_up.weight")
    path = write_gguf(tmp_path / "renamed.gguf", tensors)
    with refused(MissingTensorError, r"missing: model\.layers\.1\.mlp\.up_proj\.weight", path):
        llama_jax.load_checkpoint(path)


def test_gguf_extra_tensor(tmp_path):
    """A GGUF tensor the model has no place for (an MoE router) is named as unexpected; a bias in one layer only
    (the biases a file has are read from layer 0's tensors) names the other layers' as missing."""
    tensors = {GGUF_NAME[n]: a for n, a in random_tensors(CONFIG).items()}
    tensors["blk.0.ffn_gate_inp.weight"] = np.zeros((4, CONFIG.dim), np.float32)
    path = write_gguf(tmp_path / "extra.gguf", tensors)
    with refused(UnexpectedTensorError, r"no place .*: blk\.0\.ffn_gate_inp\.weight", path):
        llama_jax.load_checkpoint(path)
    del tensors["blk.0.ffn_gate_inp.weight"]
    tensors["blk.0.attn_q.bias"] = np.zeros(CONFIG.qw, np.float32)
    path = write_gguf(tmp_path / "bias.gguf", tensors)
    with refused(MissingTensorError, r"missing: model\.layers\.1\.self_attn\.q_proj\.bias \(blk\.1\.attn_q", path):
        llama_jax.load_checkpoint(path)


def test_gguf_tensor_of_the_wrong_shape(tmp_path):
    """A GGUF tensor stored transposed is named with the shape found and the shape expected."""
    tensors = {GGUF_NAME[n]: a for n, a in random_tensors(CONFIG).items()}
    tensors["blk.1.ffn_down.weight"] = np.ascontiguousarray(tensors["blk.1.ffn_down.weight"].T)
    path = write_gguf(tmp_path / "shape.gguf", tensors)
    match = (
        r"model\.layers\.1\.mlp\.down_proj\.weight \(blk\.1\.ffn_down\.weight\) has shape \(24, 32\),"
        r" but the config gives \(32, 24\)"
    )
    with refused(TensorShapeError, match, path):
        llama_jax.load_checkpoint(path)


def test_gguf_tensor_of_an_unsupported_ggml_type(tmp_path):
    """A tensor of a type the gguf package does not dequantize (Q8_1, an activation type) is named with its type."""
    tensors: dict[str, Any] = {GGUF_NAME[n]: a for n, a in random_tensors(CONFIG).items()}
    rows, cols = tensors["blk.0.attn_q.weight"].shape
    raw = np.zeros((rows, cols // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), np.uint8)
    tensors["blk.0.attn_q.weight"] = (raw, Q.Q8_1)
    path = write_gguf(tmp_path / "q8_1.gguf", tensors)
    with refused(UnsupportedDTypeError, r"tensor 'blk\.0\.attn_q\.weight' is stored as Q8_1", path):
        llama_jax.load_checkpoint(path)


def test_gguf_not_llama(tmp_path):
    """A GGUF file of an architecture outside the family is a ConfigError naming general.architecture."""
    path = write_gguf(tmp_path / "gemma.gguf", arch="gemma")
    with refused(ConfigError, "general.architecture is 'gemma'; llama-jax runs the architectures llama, qwen2", path):
        llama_jax.load_checkpoint(path)


@pytest.mark.parametrize(
    "key",
    [
        "llama.block_count",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.attention.head_count",
        "llama.attention.layer_norm_rms_epsilon",
    ],
)
def test_gguf_missing_metadata(tmp_path, key):
    """A GGUF file without a metadata key the config needs names the key."""
    path = write_gguf(tmp_path / "meta.gguf", **{key.replace(".", "__"): None})
    with refused(ConfigError, f"missing metadata key '{key}'", path):
        llama_jax.load_checkpoint(path)


@pytest.mark.parametrize(
    ("meta", "cls", "match"),
    [
        ({"llama__block_count": 3}, MissingTensorError, r"9 tensor\(s\) .* missing: model\.layers\.2\."),
        ({"llama__feed_forward_length": 48}, TensorShapeError, r"\(blk\.0\.ffn_gate\.weight\) has shape \(24, 32\)"),
        ({"llama__vocab_size": 300}, TensorShapeError, r"\(token_embd\.weight\) has shape \(260, 32\)"),
        ({"llama__rope__dimension_count": 4}, ConfigError, "rope.dimension_count 4 is not the head size 8"),
        ({"llama__rope__scaling__type": "longrope"}, ConfigError, "RoPE scaling 'longrope' .* is not supported"),
        ({"llama__attention__head_count": 3}, ConfigError, "do not make kv groups"),
        ({"llama__vocab_size": 250}, TensorShapeError, r"\(token_embd\.weight\) has shape \(260, 32\)"),
    ],
    ids=["block_count", "feed_forward_length", "vocab_size", "rope-dims", "rope-scaling", "head_count", "vocab-small"],
)
def test_gguf_metadata_contradicting_the_weights(tmp_path, meta, cls, match):
    """GGUF metadata whose sizes differ from the tensors', or that asks for unsupported features."""
    path = write_gguf(tmp_path / "meta.gguf", **meta)
    with refused(cls, match, path):
        llama_jax.load_checkpoint(path)


def test_gguf_without_head_count_kv(tmp_path):
    """Without llama.attention.head_count_kv, kv defaults to the query heads: the k projection (3 heads of 8 rows
    for 1 kv head) has the wrong shape, a TensorShapeError naming it, not a failed reshape while the rows are
    unpermuted (found by fuzzing the real file)."""
    config = tiny_config(kv=1, g=3)  # dim 24, kvw 8: 8 rows cannot be unpermuted as 3 heads
    path = gguf_builder.write_gguf(
        tmp_path / "kv.gguf", config, random_tensors(config), llama__attention__head_count_kv=None
    )
    match = r"self_attn\.k_proj\.weight \(blk\.0\.attn_k\.weight\) has shape \(8, 24\), but the config gives \(24, 24\)"
    with refused(TensorShapeError, match, path):
        llama_jax.load_checkpoint(path)


def test_gguf_tokenizer_larger_than_the_vocabulary(tmp_path):
    """More tokenizer.ggml.tokens than llama.vocab_size (and the embedding's rows) is a ConfigMismatchError."""
    tokens = [*gguf_metadata(CONFIG)["tokenizer.ggml.tokens"], "<extra>"]
    path = write_gguf(tmp_path / "tok.gguf", tokenizer__ggml__tokens=tokens, tokenizer__ggml__token_type=[1] * 261)
    with refused(ConfigMismatchError, "the tokenizer has 261 tokens but the model's vocabulary has 260", path):
        llama_jax.load_checkpoint(path)


def test_gguf_eos_outside_the_vocabulary(tmp_path):
    """A tokenizer.ggml.eos_token_id beyond the vocabulary is a ConfigMismatchError."""
    path = write_gguf(tmp_path / "eos.gguf", tokenizer__ggml__eos_token_id=5000)
    with refused(ConfigMismatchError, "end-of-sequence id 5000 is outside the vocabulary", path):
        llama_jax.load_checkpoint(path)


@pytest.mark.parametrize(
    ("meta", "cls", "match"),
    [
        ({"tokenizer__ggml__token_type": [1] * 10}, CorruptFileError, "tokenizer metadata .* is malformed"),
        ({"tokenizer__ggml__merges": ["Ġt"]}, CorruptFileError, "a tokenizer merge is not two tokens"),
        ({"tokenizer__ggml__model": "bert"}, CheckpointError, "tokenizer.ggml.model is 'bert'"),
        ({"tokenizer__ggml__pre": "kimi-k2"}, CheckpointError, "tokenizer.ggml.pre 'kimi-k2' is not a byte-level"),
        ({"tokenizer__ggml__tokens": 5}, CorruptFileError, "'tokenizer.ggml.tokens' is not a list of str values"),
        ({"tokenizer__ggml__merges": [1, 2]}, CorruptFileError, "'tokenizer.ggml.merges' is not a list of str"),
        ({"tokenizer__ggml__merges": ["Ġ x"]}, CorruptFileError, "does not make a tokenizer .*Ġx"),
        (
            {"tokenizer__ggml__model": "llama", "tokenizer__ggml__scores": [0.0] * 3},
            CorruptFileError,
            "3 tokenizer scores for 260 tokens",
        ),
        ({"tokenizer__ggml__scores": ["a"]}, CorruptFileError, "'tokenizer.ggml.scores' is not a list of float or int"),
    ],
    ids=[
        "token_type-length",
        "merge-without-space",
        "unknown-kind",
        "unknown-pre",
        "tokens-number",
        "merges-numbers",
        "merge-out-of-vocabulary",
        "sentencepiece-scores-length",
        "scores-strings",
    ],
)
def test_gguf_bad_tokenizer_metadata(tmp_path, meta, cls, match):
    """Tokenizer metadata that is malformed, or of a kind llama-jax cannot rebuild, names the key."""
    path = write_gguf(tmp_path / "tok.gguf", **meta)
    with refused(cls, match, path):
        llama_jax.load_checkpoint(path)


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        pytest.param({"llama__block_count": "two"}, "llama.block_count"),
        pytest.param({"llama__embedding_length": [32]}, "llama.embedding_length"),
        pytest.param({"tokenizer__ggml__eot_token_id": ["a"]}, "tokenizer.ggml.eot_token_id is \\['a'\\]"),
        pytest.param({"tokenizer__ggml__bos_token_id": "1"}, "tokenizer.ggml.bos_token_id is '1'; expected a token id"),
        pytest.param({"tokenizer__ggml__add_bos_token": 1}, "tokenizer.ggml.add_bos_token is 1; expected true or"),
    ],
    ids=["block_count-string", "embedding_length-array", "eot_token_id-strings", "bos-string", "add_bos-number"],
)
def test_gguf_metadata_of_the_wrong_type(tmp_path, meta, match):
    """A GGUF metadata value of the wrong type is a ConfigError naming the key, not a bare Python error."""
    path = write_gguf(tmp_path / "meta.gguf", **meta)
    with refused(ConfigError, match, path):
        llama_jax.load_checkpoint(path)


# ---- the real SmolLM2 file, cut ----


@pytest.mark.parametrize(
    ("cut", "cls", "match"),
    [
        ("data", TensorSpanError, "past the end of the file"),
        ("header", TruncatedFileError, f"the file ends at byte {2**19}, but"),
    ],
)
def test_real_gguf_truncated(default_path, tmp_path, cut, cls, match):
    """The real SmolLM2 file, cut 1 MiB before its end or 512 KiB into its header (the vocabulary), is refused
    while its header is read, before any tensor is."""
    path = tmp_path / default_path.name
    with open(default_path, "rb") as f:
        size = default_path.stat().st_size
        path.write_bytes(f.read(size - 2**20 if cut == "data" else 2**19))
    with refused(cls, match, path):
        llama_jax.load_checkpoint(path)
