"""Native CPU kernels of a decode step, compiled on first use for this machine and called from jitted code
through XLA's FFI (see decode.cc for why each exists):

- `matvec(w, layer, x)`: x · w[layer]ᵀ, read straight from the stacked weights (f32 or bf16);
- `attend(k, v, layer, last, q)`: one query position per sequence against the cache, read in place.

They are built with the system C++ compiler (g++ -O3 -march=native against the FFI headers
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

SOURCE = Path(__file__).with_name("decode.cc")
TARGETS = {jnp.dtype(jnp.float32): "llama_jax_matvec_f32", jnp.dtype(jnp.bfloat16): "llama_jax_matvec_bf16"}
ATTEND = "llama_jax_attend"


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
    target = root / "kernels" / f"decode-{digest}.so"
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
        ("LlamaJaxAttend", ATTEND),
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


def attend(
    k: Float[Array, "L B K S H"],
    v: Float[Array, "L B K S H"],
    layer: Int[Array, ""],
    last: Int[Array, " B"],
    q: Float[Array, "B N H"],
) -> Float[Array, "B N H"]:
    """softmax(q · kᵀ / sqrt(H)) · v of one query per sequence over cache slots 0..last[b] of layer `layer`, each
    query head j·G + i against key/value head j (call only where `available()`; f32 caches)."""
    if _library() is None:
        raise RuntimeError("the native attention kernel is not available here; use XLA's attention (native=False)")
    call = jax.ffi.ffi_call(ATTEND, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(k.astype(jnp.float32), v.astype(jnp.float32), jnp.asarray(layer, jnp.int32), last, q)
