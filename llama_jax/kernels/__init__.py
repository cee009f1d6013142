"""Native CPU kernels, compiled on first use for this machine and called from jitted code through XLA's FFI.

`matvec(w, layer, x)`: x · w[layer]ᵀ for a decode step, read straight from the stacked weights (see
matvec.cc for why). It is built with the system C++ compiler (g++ -O3 -march=native against the FFI headers
jaxlib ships) into the cache directory (see `caches`) and reused by later processes. Where it cannot be built
(no compiler, no AVX2/FMA, not x86-64, a cache that refuses the file), `available()` is False and the passes use
XLA's own products instead: the same numbers to float rounding, slower.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from llama_jax.caches import cache_root

SOURCE = Path(__file__).with_name("matvec.cc")
TARGETS = {jnp.dtype(jnp.float32): "llama_jax_matvec_f32", jnp.dtype(jnp.bfloat16): "llama_jax_matvec_bf16"}


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _build(target: Path) -> None:
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise OSError("no C++ compiler (g++) on PATH")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [
                compiler,
                "-O3",
                "-march=native",
                "-std=c++17",
                "-shared",
                "-fPIC",
                "-w",
                f"-I{jax.ffi.include_dir()}",
                str(SOURCE),
                "-o",
                str(built),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        built.replace(target)


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The compiled kernels, registered with XLA; None where they cannot be had (the reason goes to stderr once)."""
    if platform.machine() not in ("x86_64", "AMD64") or not _cpu_has_avx2_fma():
        return None
    digest = hashlib.sha256(SOURCE.read_bytes() + jax.__version__.encode()).hexdigest()[:16]
    root = cache_root() or Path(tempfile.gettempdir()) / "llama-jax"
    target = root / "kernels" / f"matvec-{digest}.so"
    try:
        if not target.exists():
            _build(target)
        library = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        print(f"llama-jax: native kernels unavailable ({detail.strip()[:200]}); using XLA's products", file=sys.stderr)
        return None
    for symbol, name in (
        ("LlamaJaxMatvecF32", TARGETS[jnp.dtype(jnp.float32)]),
        ("LlamaJaxMatvecBF16", TARGETS[jnp.dtype(jnp.bfloat16)]),
    ):
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
    return library


def available() -> bool:
    return _library() is not None


def matvec(w: Float[Array, "L O I"], layer: Int[Array, ""], x: Float[Array, "B I"]) -> Float[Array, "B O"]:
    """x · w[layer]ᵀ in f32 for f32 or bf16 weights (call only where `available()`)."""
    if _library() is None:
        raise RuntimeError("the native matvec kernel is not available here; use XLA's products (native=False)")
    call = jax.ffi.ffi_call(TARGETS[jnp.dtype(w.dtype)], jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32))
    return call(w, jnp.asarray(layer, jnp.int32), x.astype(jnp.float32))
