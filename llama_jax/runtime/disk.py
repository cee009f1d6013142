"""The on-disk caches that make a start fast, all under one folder: $LLAMA_JAX_CACHE, default
$XDG_CACHE_HOME/llama-jax or ~/.cache/llama-jax; LLAMA_JAX_CACHE=off: nowhere.

- converted/: the default model dequantized once into a Hugging Face directory (f32 safetensors), read straight
  into the weights on later loads instead of dequantizing the GGUF file again (`loaders.default_model`).
- executables/: the compiled prefill, decode and scoring executables (`runtime.executables`).
- xla/: JAX's persistent compilation cache, so a new process reuses the compiled prefill and decode steps.
  JAX's setting is process-wide, so it is switched on only by LLAMA_JAX_COMPILATION_CACHE=DIR or by calling
  `enable_compilation_cache()`.

LLAMA_JAX_CACHE=off turns the converted and executables caches off (the compilation cache is off unless asked
for).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

ENV = "LLAMA_JAX_CACHE"
COMPILATION_CACHE_ENV = "LLAMA_JAX_COMPILATION_CACHE"


def cache_root() -> Path | None:
    """The cache directory, None when LLAMA_JAX_CACHE=off."""
    value = os.environ.get(ENV, "")
    if value.lower() in ("off", "0", "none"):
        return None
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-jax"
    return Path(value) if value else base


def enable_compilation_cache(directory: str | Path | None = None) -> Path:
    """Switches JAX's persistent compilation cache on (process-wide), caching every compilation, however quick."""
    import jax

    root = cache_root()
    path = Path(directory) if directory else (root or Path(tempfile.gettempdir()) / "llama-jax") / "xla"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
