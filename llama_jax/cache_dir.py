"""Where llama-jax keeps its on-disk caches (converted weights, compiled executables, JAX's compilation cache):
$LLAMA_JAX_CACHE, default $XDG_CACHE_HOME/llama-jax or ~/.cache/llama-jax; LLAMA_JAX_CACHE=off: nowhere."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path | None:
    """The cache directory, None when LLAMA_JAX_CACHE=off."""
    value = os.environ.get("LLAMA_JAX_CACHE", "")
    if value.lower() in ("off", "0", "none"):
        return None
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "llama-jax"
    return Path(value) if value else base
