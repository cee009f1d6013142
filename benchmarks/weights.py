"""The same weights for every engine: the default model's GGUF (Q4_1), dequantized once, written as F32 and BF16
GGUF files for llama.cpp (tensor names, layout and metadata as in the original) and as Hugging Face directories
for transformers (llama-jax's convert). Kept in benchmarks/.cache/ and reused."""

from __future__ import annotations

from pathlib import Path

import gguf
import ml_dtypes
import numpy as np

from llama_jax import convert_gguf, default_model_path
from llama_jax.loaders.gguf_file import GGUFFile

CACHE = Path(__file__).resolve().parent / ".cache"


def _write_gguf(source: Path, out: Path, target: gguf.GGMLQuantizationType) -> None:
    """source's metadata and tensors, every tensor dequantized and stored as target (1-D tensors stay F32, as
    llama.cpp's converter keeps them). The rows stay in llama.cpp's order: nothing is permuted or unpermuted."""
    f = GGUFFile(source)
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(out), f.metadata["general.architecture"])
    skip = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.file_type"}
    for key, field in reader.fields.items():
        if key in skip:
            continue
        vtype = field.types[0]
        value = field.contents()
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, vtype, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, value, vtype)
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


def prepare() -> dict[str, Path]:
    """The files of every engine, made if missing."""
    CACHE.mkdir(exist_ok=True)
    source = default_model_path()
    paths = {
        "q4_1": source,
        "gguf-f32": CACHE / "smollm2-135m-instruct.f32.gguf",
        "gguf-bf16": CACHE / "smollm2-135m-instruct.bf16.gguf",
        "hf-f32": CACHE / "hf-f32",
        "hf-bf16": CACHE / "hf-bf16",
    }
    for key, target in (("gguf-f32", gguf.GGMLQuantizationType.F32), ("gguf-bf16", gguf.GGMLQuantizationType.BF16)):
        if not paths[key].exists():
            _write_gguf(source, paths[key], target)
    for key, dtype in (("hf-f32", "float32"), ("hf-bf16", "bfloat16")):
        if not (paths[key] / "model.safetensors").exists():
            convert_gguf(source, paths[key], dtype=dtype)
    return paths
