"""Native CPU kernels of a decode step, called from jitted code through XLA's FFI (see decode.cc for why each
exists and for their contracts: batch invariance, and progress on any thread pool):

- `matvec(w, layer, x)`: x · w[layer]ᵀ, read straight from the stacked weights (f32, bf16, f16, or ggml's
  Q4_0, Q4_1, Q8_0 blocks widened to their exact f32 values);
- `attend(k, v, layer, last, q)`: one query position per sequence against the cache, read in place.

They are compiled when the package is installed (setup.py, one library per instruction-set variant) and chosen
at run time (`library.status`): LLAMA_JAX_NATIVE=auto (the default) runs them where they can run and XLA's own
products elsewhere (the same numbers to float rounding, slower), off never runs them, require raises
NativeKernelError where they cannot run. Call these two functions only where `status(...).active`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from llama_jax.core.quantized import Blocks, kind
from llama_jax.core.weights import Weights
from llama_jax.errors import NativeKernelError
from llama_jax.kernels.library import ATTEND, MATVEC, NativeStatus, status
from llama_jax.runtime.executables import on_one_device

__all__ = ["NativeStatus", "attend", "default_native", "matvec", "status"]


def default_native(weights: Weights) -> bool:
    """Whether a pass called without `native` runs the native kernels: where the switch ($LLAMA_JAX_NATIVE) and the
    CPU let them and the weights lie whole on one device. A Model decides this once (`Model.native`) and passes it
    down."""
    return status(sharded=not on_one_device(weights.lnf)).active  # the weights lie on one device, or on several


def _require_loaded() -> None:
    if not status("auto").active:
        raise NativeKernelError(f"a native kernel was called, but {status('auto')}; pass native=False")


def matvec(w: Float[Array, "L O I"] | Blocks, layer: Int[Array, ""], x: Float[Array, "B I"]) -> Float[Array, "B O"]:
    """x · w[layer]ᵀ in f32, for weights held in any of the kinds in `library.MATVEC`."""
    _require_loaded()
    call = jax.ffi.ffi_call(MATVEC[kind(w)], jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32))
    data = w.blocks if isinstance(w, Blocks) else w
    return call(data, jnp.asarray(layer, jnp.int32), x.astype(jnp.float32))


def attend(
    k: Float[Array, "L B K S H"],
    v: Float[Array, "L B K S H"],
    layer: Int[Array, ""],
    last: Int[Array, " B"],
    q: Float[Array, "B N H"],
) -> Float[Array, "B N H"]:
    """softmax(q · kᵀ / sqrt(H)) · v of one query per sequence over cache slots 0..last[b] of layer `layer`, each
    query head j·G + i against key/value head j (f32 caches)."""
    _require_loaded()
    call = jax.ffi.ffi_call(ATTEND, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(k.astype(jnp.float32), v.astype(jnp.float32), jnp.asarray(layer, jnp.int32), last, q)
