"""The on-disk caches that make a start fast, all under $LLAMA_JAX_CACHE (default ~/.cache/llama-jax):

- converted/: the default model dequantized once into a Hugging Face directory (f32 safetensors), read
  straight into the weights on later loads instead of dequantizing the GGUF file again.
  Keyed by the GGUF file's name, size and mtime.
- executables/: the compiled prefill, decode and scoring executables (`executables`).
- xla/: JAX's persistent compilation cache, so a new process reuses the compiled prefill and decode steps.
  JAX's setting is process-wide, so it is switched on only by LLAMA_JAX_COMPILATION_CACHE=DIR or
  by calling `enable_compilation_cache()`.

LLAMA_JAX_CACHE=off turns the converted and executables caches off (the compilation cache is off unless asked
for).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import jax

from llama_jax.cache_dir import cache_root
from llama_jax.convert import convert_gguf


def converted_default(gguf_path: Path) -> Path | None:
    """A dequantized Hugging Face copy of the default GGUF file, made on first use (written to a temporary
    directory, then renamed, so a crash never leaves half a checkpoint); None when the cache is off or the disk
    refuses it."""
    root = cache_root()
    if root is None:
        return None
    stat = gguf_path.stat()
    target = root / "converted" / f"{gguf_path.stem}-{stat.st_size}-{int(stat.st_mtime)}"
    if (target / "model.safetensors").exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            convert_gguf(gguf_path, Path(tmp) / "model", dtype="float32")
            shutil.move(str(Path(tmp) / "model"), target)
    except OSError:
        return None
    return target


def enable_compilation_cache(directory: str | Path | None = None) -> Path:
    """Switches JAX's persistent compilation cache on (process-wide), caching every compilation, however quick."""
    root = cache_root()
    path = Path(directory) if directory else (root or Path(tempfile.gettempdir()) / "llama-jax") / "xla"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
