"""The same weights for every engine: the default model's GGUF (Q4_1), dequantized once, written as F32 and BF16
GGUF files for llama.cpp (tensor names, layout and metadata as in the original) and as Hugging Face directories
for transformers (llama-jax's convert). Kept outside the repository, in $LLAMA_JAX_BENCH_CACHE (default
$XDG_CACHE_HOME/llama-jax-bench, ~/.cache/llama-jax-bench), and reused: a fresh clone finds them, and `make clean`
leaves them (an 8B model's files are 13 GB and 11 minutes to make).

prepare(config) does the same for a model of another shape (a Hugging Face config.json, e.g.
configs/smollm2-1.7b.json, configs/family/llama-3.2-1b.json, configs/family/qwen3-0.6b.json): its Q4_1 file is
written first, random weights laid out as the default model's file under the family's GGUF architecture, with the
tokenizer of its vocabulary size. prepare(config, "Q4_K_M") (or "Q8_0") writes the
same random weights as a Q8_0 file, requantizes it with llama.cpp's own `llama_model_quantize` (as the hub's Q4_K_M
files are made: Q4_K matrices, Q6_K for some layers' attn_v and ffn_down and for the tied embedding) and makes the
other engines' files from that one, dequantized."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import ml_dtypes
import numpy as np

from llama_jax import convert_gguf, default_model_path
from llama_jax.core import arrays
from llama_jax.core.config import LlamaConfig
from llama_jax.loaders.checkpoint import GGUF_PERMUTED, load_checkpoint
from llama_jax.loaders.convert import write_checkpoint
from llama_jax.loaders.gguf_file import GGUFFile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' GGUF helpers, from the source tree
from tests.gguf_builder import gguf_arch, gguf_metadata, llama3_rope_freqs, llama_cpp_permute
from tests.helpers import llama_cpp_models

CACHE = Path(
    os.environ.get("LLAMA_JAX_BENCH_CACHE")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama-jax-bench"
)
SEED = 0
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, changes: dict) -> None:
    """reader's metadata into writer, key by key in its order, each of `changes` replacing a key's value (None:
    the key left out). GGUF's own counts and the architecture are left to the writer."""
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture"}
    for key, field in reader.fields.items():
        value = changes.get(key, field.contents())
        if key in skip or value is None:
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)


def _write_gguf(source: Path, out: Path, target: gguf.GGMLQuantizationType) -> None:
    """source's metadata and tensors, every tensor dequantized and stored as target (1-D tensors stay F32, as
    llama.cpp's converter keeps them). The rows stay in llama.cpp's order: nothing is permuted or unpermuted."""
    f = GGUFFile(source)
    writer = gguf.GGUFWriter(str(out), f.metadata["general.architecture"])
    _copy_metadata(gguf.GGUFReader(source), writer, {"general.file_type": None})
    writer.add_file_type({gguf.GGMLQuantizationType.F32: 0, gguf.GGMLQuantizationType.BF16: 32}[target])
    for name in f.tensors:
        array = f.read(name)
        if array.ndim == 1 or target == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, array.astype(np.float32))
        else:
            writer.add_tensor(name, array.astype(ml_dtypes.bfloat16).view(np.uint16), raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _vocabulary(vocab_size: int) -> Path:
    """The GGUF whose tokenizer a random model of vocab_size tokens takes: the default model's (49,152), or the
    first of llama.cpp's own vocabulary files of that size by name (ggml-vocab-llama-bpe.gguf: Llama 3's and
    SmolLM3's 128,256; -llama-spm: Llama 2's 32,000; -qwen2: Qwen2.5's and Qwen3's 151,936; -phi-3: 32,064), from
    llama-cpp-python's sdist as the tests fetch it."""
    candidates = [default_model_path()]
    if vocab_size != len(gguf.GGUFReader(candidates[0]).fields["tokenizer.ggml.tokens"].data):
        candidates = sorted(llama_cpp_models().glob("ggml-vocab-*.gguf"))
    for path in candidates:
        if len(gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"].data) == vocab_size:
            return path
    raise ValueError(f"no vocabulary of {vocab_size} tokens: a random model takes the default model's or one of "
                     "llama.cpp's vocabulary files")  # fmt: skip


def _rope_freqs(config: dict) -> np.ndarray | None:
    """The `rope_freqs.weight` llama.cpp's converter writes for the config's RoPE scaling (llama3), None without
    one; other scalings are refused (this writer does not write their keys)."""
    scaling = config.get("rope_scaling")
    if not scaling:
        return None
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        raise ValueError(f"a random model takes no RoPE scaling or llama3's, not {scaling}")
    return llama3_rope_freqs(LlamaConfig.from_hf(config))


def _write_random_gguf(
    config: dict, out: Path, title: str, seed: int = SEED, matrices: gguf.GGMLQuantizationType | None = None
) -> None:
    """A GGUF file of config's shape (a Hugging Face config.json of a Llama-family model: llama, qwen2, qwen3,
    smollm3, granite), laid out as llama.cpp's converter writes the family and as the default model's file: its
    metadata (the shape's keys under the family's architecture), tensor names, order and types (token embeddings
    Q8_0, matrices Q4_1, norms and biases F32, by gguf-py's quantizer; a family's per-head norms and biases after a
    layer's own tensors; an untied LM head `output.weight` last), the tokenizer of that vocabulary size
    (_vocabulary), a llama3 scaling as llama.cpp's `rope_freqs.weight`, q and k rows in llama.cpp's order where its
    converter permutes them (drawn in Hugging Face's, then permuted). Weights from `seed`, drawn in the file's
    order: matrices and biases normal(0, initializer_range), norms 1 + normal(0, initializer_range). One tensor is
    drawn and quantized at a time; the file's blocks (about 0.6 bytes a weight) are held until written. title: its
    general.name (the config's name). matrices: every matrix in this type instead (the source llama.cpp's quantizer
    reads: Q8_0, a quarter of F32's bytes, 8.5 GB for 8B weights, requantized as the hub's files of an 8B model
    are made)."""
    source = gguf.GGUFReader(default_model_path())
    types = {t.name: t.tensor_type for t in source.tensors}
    vocabulary = _vocabulary(config["vocab_size"])
    llama = LlamaConfig.from_hf(config)
    if llama.family in arrays.FUSED_FAMILIES or llama.rope.kind not in ("default", "llama3"):
        raise ValueError(f"a random model's file is not written for {llama.family} with {llama.rope.kind} RoPE")
    arch = gguf_arch(llama)
    checkpoint = arrays.checkpoint_arrays(llama)  # the family's tensors and shapes, by Hugging Face name
    parts = [name.split(".")[2] for name in types if name.startswith("blk.0.")]  # the default file's order
    names = {spec.gguf.format(i): spec.checkpoint_shape(llama) for _, spec, i in checkpoint.values()}
    tensors = {"token_embd.weight": names["token_embd.weight"]}
    for i in range(llama.layers):
        layer = [f"blk.{i}.{part}.weight" for part in parts]
        layer += sorted(n for n in names if n.startswith(f"blk.{i}.") and n not in layer)
        tensors |= {name: names[name] for name in layer}
    tensors["output_norm.weight"] = names["output_norm.weight"]
    if not llama.tied:
        tensors["output.weight"] = names["output.weight"]
        types["output.weight"] = types["token_embd.weight"]
    size = sum(math.prod(shape) for shape in tensors.values())
    label = f"{size / 1e9:.1f}B" if size >= 1e9 else f"{size / 1e6:.0f}M"
    writer = gguf.GGUFWriter(str(out), arch)
    changes = {"general.name": f"{title} shape, random weights (seed {seed})", "general.size_label": label}
    changes |= {"general.finetune": None} | {key: None for key in source.fields if key.startswith("llama.")}
    if matrices is not None:
        changes["general.file_type"] = {gguf.GGMLQuantizationType.F32: 0, gguf.GGMLQuantizationType.Q8_0: 7}[matrices]
    if vocabulary != default_model_path():  # another vocabulary: its tokenizer keys instead of the default's
        changes |= {key: None for key in source.fields if key.startswith("tokenizer.")}
    _copy_metadata(source, writer, changes)
    shape_keys = {key: value for key, value in gguf_metadata(llama).items() if key.startswith(f"{arch}.")}
    for key, value in shape_keys.items():  # the family's keys as its converter writes them
        vtype = gguf.GGUFValueType.UINT32 if type(value) is int else gguf.GGUFValueType.FLOAT32
        writer.add_key_value(key, value, vtype)
    if vocabulary != default_model_path():
        other = gguf.GGUFReader(vocabulary)
        _copy_metadata(other, writer, {key: None for key in other.fields if not key.startswith("tokenizer.")})
    rope_freqs = _rope_freqs(config)
    if rope_freqs is not None:
        writer.add_tensor(arrays.ROPE_FREQS, rope_freqs)
    rng, std = np.random.default_rng(seed), config["initializer_range"]
    permuted = llama.family in GGUF_PERMUTED
    for name, shape in tensors.items():
        w = rng.standard_normal(shape, dtype=np.float32) * np.float32(std)
        if permuted and (".attn_q." in name or ".attn_k." in name):  # convert_hf_to_gguf.py's permute (and biases)
            w = llama_cpp_permute(w, llama.heads if ".attn_q." in name else llama.kv)
        if w.ndim == 1:
            writer.add_tensor(name, w if name.endswith(".bias") else w + np.float32(1))
            continue
        ggml_type = matrices or types[re.sub(r"^blk\.\d+\.", "blk.0.", name)]
        if ggml_type == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, ggml_type), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _quantize(source: Path, out: Path, file_type: str) -> None:
    """source (a Q8_0 GGUF) requantized to file_type by llama.cpp's own quantizer (llama-cpp-python's binding of
    llama_model_quantize), which chooses each tensor's type as llama.cpp's `llama-quantize` does."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.allow_requantize = True
    params.nthread = len(os.sched_getaffinity(0))
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama_model_quantize failed to write {out} from {source}")


def _convert_stored(source: Path, out_dir: Path, dtype: str, config: dict) -> None:
    """convert_gguf's directory, read from the file's stored blocks and dequantized a tensor at a time as it is
    written, not from a float32 copy of the whole model beside the written one (13.7 GB for 1.7B weights). Its
    RoPE is config's: a `rope_freqs` tensor has no config.json form, the llama3 scaling it was written from has."""
    checkpoint = load_checkpoint(source, dtype="stored")
    rope = LlamaConfig.from_hf(config).rope
    checkpoint = dataclasses.replace(checkpoint, config=dataclasses.replace(checkpoint.config, rope=rope))
    write_checkpoint(checkpoint, out_dir, dtype)


def _made(path: Path, write: Callable[[Path], object]) -> None:
    """write(a temporary path) renamed to path, when path is missing: an interrupted run leaves no half-written
    file or directory behind to be taken for a whole one."""
    if not path.exists():
        part = path.with_name(path.name + ".part")
        if part.is_dir():  # an interrupted run's
            shutil.rmtree(part)
        write(part)
        part.replace(path)


def stored_file(config: Path, file_type: str = "Q4_1") -> Path:
    """The file of a random model of config's shape (a Hugging Face config.json) that llama-jax and llama.cpp
    compute on as stored, made if missing (Q4_1: _write_random_gguf; another type, Q4_K_M: _quantize of its Q8_0
    file, which is made only then and may be deleted after), in CACHE."""
    CACHE.mkdir(parents=True, exist_ok=True)
    stem, hf_config = f"{config.stem}-random", json.loads(config.read_text())
    if file_type == "Q4_1":
        source = CACHE / f"{stem}.q4_1.gguf"
        _made(source, lambda out: _write_random_gguf(hf_config, out, config.stem))
        return source
    q8 = CACHE / f"{stem}.source-q8_0.gguf"
    source = CACHE / f"{stem}.{file_type.lower()}.gguf"
    if not source.exists():  # the Q8_0 source only to make it: it may be deleted after (8.5 GB at 8B)
        _made(q8, lambda out: _write_random_gguf(hf_config, out, config.stem, matrices=Q8_0))
    _made(source, lambda out: _quantize(q8, out, file_type))
    return source


def prepare(
    config: Path | None = None, file_type: str = "Q4_1", keys: set[str] | None = None
) -> dict[str, Path | None]:
    """The files of every engine, made if missing: the default model's, or with config (a Hugging Face
    config.json) a random model of that shape's, its file of `file_type` first (Q4_1: _write_random_gguf; Q4_K_M,
    Q8_0: _quantize of its Q8_0 file), then those of `keys` from it (default: all; a run's engines' files).
    "llama-jax": the file llama-jax loads, None for the default model (llama_jax.load's own default); "stored": the
    file llama-jax and llama.cpp compute on as stored."""
    CACHE.mkdir(parents=True, exist_ok=True)
    if config is None:
        if file_type != "Q4_1":
            raise ValueError(f"the default model's file is Q4_1, not {file_type}: give --model with {file_type}")
        source, stem, hf, convert = default_model_path(), "smollm2-135m-instruct", "", convert_gguf
    else:
        stem, hf_config = f"{config.stem}-random", json.loads(config.read_text())
        source = stored_file(config, file_type)
        stem = stem if file_type == "Q4_1" else f"{stem}.{file_type.lower()}"
        hf = f"{stem}."

        def convert(source: Path, out: Path, dtype: str) -> None:
            _convert_stored(source, out, dtype, hf_config)

    paths = {
        "llama-jax": None if config is None else source,
        "stored": source,
        "gguf-f32": CACHE / f"{stem}.f32.gguf",
        "gguf-bf16": CACHE / f"{stem}.bf16.gguf",
        "hf-f32": CACHE / f"{hf}hf-f32",
        "hf-bf16": CACHE / f"{hf}hf-bf16",
    }
    paths = {key: path for key, path in paths.items() if keys is None or key in keys | {"llama-jax", "stored"}}
    for key, target in (("gguf-f32", gguf.GGMLQuantizationType.F32), ("gguf-bf16", gguf.GGMLQuantizationType.BF16)):
        if key in paths:
            _made(paths[key], lambda out, target=target: _write_gguf(source, out, target))
    for key, dtype in (("hf-f32", "float32"), ("hf-bf16", "bfloat16")):
        if key in paths:
            _made(paths[key], lambda out, dtype=dtype: convert(source, out, dtype=dtype))
    return paths


def weight_bytes(path: Path, width: int | None = None) -> int:
    """The bytes of weights a decode step reads, each weight once (a tied LM head is the embedding): a GGUF file's
    tensors as stored, or at `width` bytes an element (llama-jax loading that file as f32 or bf16), or a Hugging
    Face directory's safetensors."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    tensors = gguf.GGUFReader(path).tensors
    return sum(int(t.n_bytes) if width is None else int(t.n_elements) * width for t in tensors)
