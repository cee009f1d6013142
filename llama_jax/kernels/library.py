"""Which native kernel library runs, and why: the switch (auto | off | require), the CPU's instruction sets, the
variant compiled when the package was installed (see `variants`), and the XLA FFI version it was built against.

Nothing is compiled at run time and nothing is cached on disk: the libraries are files of the installed package.
A process loads one variant, once, and registers its FFI targets with XLA.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import importlib.util
import os
import platform
import re
import sys
from pathlib import Path

from llama_jax.core.quantized import BY_NAME
from llama_jax.errors import InvalidArgumentError, NativeKernelError
from llama_jax.kernels.variants import VARIANTS, Variant
from llama_jax.runtime.cpu import cpu_flags

ENV = "LLAMA_JAX_NATIVE"
VARIANT_ENV = "LLAMA_JAX_NATIVE_VARIANT"  # one variant's name: only that one is loaded (to compare them)
MODES = ("auto", "off", "require")
# The native handlers, derived from one list: HELD, how a matrix is held (`quantized.kind`: the float dtypes and
# ggml's block formats, `quantized.FORMATS`) -> its trait's name in C++ (held.h), the suffix of its handlers' symbols:
# its matrix-vector product (matvec.cc), its block product (products.cc) and its scoring head (scoring.cc); beside
# them attention's (attention.cc). Each is registered with XLA under its own symbol as the FFI target name, and the
# wrappers in `kernels` call them by these names. C++ lists the traits once too (handlers.h's LLAMA_JAX_HELD): a
# library whose handlers (LlamaJaxHandlers, library.cc) or limb kinds (LlamaJaxLimbs) differ from these tables is
# refused at load. A new way of holding a matrix is its class in `quantized` (a block format) or its line here (a
# float dtype), and in C++ its trait (held.h) and its line in handlers.h.
HELD = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"} | {name: name for name in BY_NAME}
MATVEC = {held: f"LlamaJaxMatvec{trait}" for held, trait in HELD.items()}
PRODUCT = {held: f"LlamaJaxProduct{trait}" for held, trait in HELD.items()}
SCORE_HEAD = {held: f"LlamaJaxScoreHead{trait}" for held, trait in HELD.items()}
# The kinds whose matrix-vector product (a decode step's) multiplies their integer quants by int8 limbs of x, exactly,
# instead of widening them to f32 (held.h's kLimbs, limbs.h: f32 class, not the float32 copy's bits)
LIMBS = frozenset({"Q4_K", "Q5_K", "Q6_K"})
# The block kinds whose products x · Wᵀ run on AMX tiles in a library with tiles (tiles.h's BlockQuants: ggml's blocks
# of 32, d · Σ q·x + m · Σ x: f32 class, not the float32 copy's bits); bf16 weights' products run there too
TILE_BLOCKS = frozenset({"Q4_0", "Q4_1", "Q8_0"})
ATTEND = "LlamaJaxAttend"  # a decode step's: one query position per sequence (attention.cc)
ATTEND_BLOCK = "LlamaJaxAttendBlock"  # a block of query positions' (attention.cc)
ATTEND_BLOCK_GRADS = "LlamaJaxAttendBlockGrads"  # its gradient (attention.cc)
WEIGHT_GRAD = "LlamaJaxWeightGrad"  # a product's gradient with respect to its float weights (products.cc)
TILE_PRODUCT_REFERENCE = "LlamaJaxTileProductReference"  # the tiles' arithmetic in plain C++ (tiles.h)
BLOCK_TILE_REFERENCE = "LlamaJaxBlockTileReference"  # ... for ggml's blocks of 32 (tiles.h)
HANDLERS = (
    ATTEND,
    ATTEND_BLOCK,
    ATTEND_BLOCK_GRADS,
    WEIGHT_GRAD,
    TILE_PRODUCT_REFERENCE,
    BLOCK_TILE_REFERENCE,
    *MATVEC.values(),
    *PRODUCT.values(),
    *SCORE_HEAD.values(),
)


@dataclasses.dataclass(frozen=True)
class NativeStatus:
    """The outcome of the switch: `variant` names the loaded library (None: XLA's products run), `reason` why."""

    mode: str
    variant: str | None
    reason: str

    @property
    def active(self) -> bool:
        return self.variant is not None

    def sharded(self) -> NativeStatus:
        """This status for weights placed on a mesh: XLA's products (the kernels read whole arrays, not shards)."""
        return NativeStatus(self.mode, None, "the weights are sharded over a mesh") if self.active else self

    def __str__(self) -> str:
        if self.active:
            return f"native {self.variant} kernels ({self.reason})"
        return f"XLA's products ({self.reason})"


def resolve_mode(native: str | None) -> tuple[str, str]:
    """The mode asked for (an argument, else $LLAMA_JAX_NATIVE, else auto) and where it came from."""
    if native is not None:
        mode, source = native, f"native={native!r}"
    elif os.environ.get(ENV):
        mode, source = os.environ[ENV], f"{ENV}={os.environ[ENV]}"
    else:
        mode, source = "auto", "the default"
    if mode not in MODES:
        raise InvalidArgumentError(f"{source}: the native kernels' switch takes one of {', '.join(MODES)}")
    return mode, source


def status(native: str | None = None, sharded: bool = False) -> NativeStatus:
    """Whether the native kernels run under the switch (see `resolve_mode`), for weights placed on a mesh (sharded:
    never, the kernels read whole arrays) or not; NativeKernelError where they are required and cannot
    run here at all."""
    mode, source = resolve_mode(native)
    if mode == "off":
        return NativeStatus(mode, None, f"switched off by {source}")
    variant, reason = _load()
    if variant is None and mode == "require":
        raise NativeKernelError(f"the native kernels are required ({source}) but cannot run here: {reason}")
    native = NativeStatus(mode, variant, reason)
    return native.sharded() if sharded else native


def _ffi_version(include_dir: str) -> int | None:
    """The XLA FFI API version (major·1000 + minor) of the running jaxlib's headers, None if unreadable."""
    try:
        text = (Path(include_dir) / "xla" / "ffi" / "api" / "c_api.h").read_text()
    except OSError:
        return None
    numbers = re.findall(r"#define XLA_FFI_API_(MAJOR|MINOR) (\d+)", text)
    parts = dict(numbers)
    return int(parts["MAJOR"]) * 1000 + int(parts["MINOR"]) if len(parts) == 2 else None


def _library_path(variant: Variant) -> Path | None:
    spec = importlib.util.find_spec(f"llama_jax.kernels.{variant.module}")
    return Path(spec.origin) if spec is not None and spec.origin else None


def _listed(library: ctypes.CDLL, symbol: str) -> set[str]:
    """The names a library lists of itself under `symbol` (library.cc: "name,name,..."); none where it lacks the
    list (a library built before the list existed)."""
    try:
        listing = ctypes.CFUNCTYPE(ctypes.c_char_p)((symbol, library))()
    except AttributeError:
        return set()
    return {name for name in listing.decode().split(",") if name}


def _disagreement(library: ctypes.CDLL, tiles: bool) -> str | None:
    """How a library's own facts differ from this package's tables, None where they agree: the handlers it defines
    (HANDLERS), the traits whose matvec uses limbs (LIMBS) and, in a library with tiles, those whose block products
    run on them (TILE_BLOCKS). A library built from other sources would lack a handler the wrappers call, or give a
    kind's products in another class of precision than these tables state."""
    handlers = _listed(library, "LlamaJaxHandlers")
    if handlers != set(HANDLERS):
        return f"has the handlers {sorted(handlers)}, not this package's {sorted(HANDLERS)}"
    limbs, expected = _listed(library, "LlamaJaxLimbs"), {HELD[held] for held in LIMBS}
    if limbs != expected:
        return f"multiplies x's int8 limbs in the matvec of {sorted(limbs)}, not of this package's {sorted(expected)}"
    blocks, expected = _listed(library, "LlamaJaxTileBlocks"), {HELD[held] for held in TILE_BLOCKS} if tiles else set()
    if blocks != expected:
        return f"runs the block products of {sorted(blocks)} on AMX tiles, not of this package's {sorted(expected)}"
    return None


@functools.cache
def _load() -> tuple[str | None, str]:
    """The best variant this machine can run, loaded and registered with XLA (once per process), and why it was
    chosen; (None, why not) where none can run. Says so once on stderr where the CPU could run a variant that
    this install lacks."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"no native kernels for {platform.machine()} (they are written for x86-64)"
    flags = cpu_flags()
    if flags is None:
        return None, "the CPU's instruction sets are unknown (no /proc/cpuinfo)"
    fitting = [v for v in VARIANTS if flags.issuperset(v.cpu_flags)]
    chosen = os.environ.get(VARIANT_ENV)
    if chosen:
        named = [v for v in VARIANTS if v.name == chosen]
        if not named:
            return None, f"{VARIANT_ENV}={chosen} names no variant (they are {', '.join(v.name for v in VARIANTS)})"
        if named[0] not in fitting:
            return None, f"{VARIANT_ENV}={chosen}, but this CPU lacks {'+'.join(named[0].cpu_flags)}; unset it"
        fitting = named
    if not fitting:
        wanted = " or ".join("+".join(v.cpu_flags) for v in VARIANTS)
        return None, f"this CPU lacks {wanted}"
    import jax

    running = _ffi_version(jax.ffi.include_dir())
    problems = []
    for variant in fitting:
        path = _library_path(variant)
        if path is None:
            problems.append(f"{variant.name}: not built with this install (no C++ compiler when it was installed?)")
            continue
        try:
            library = ctypes.CDLL(str(path))
            built = library.LlamaJaxFfiApiVersion()
            shape = ctypes.CFUNCTYPE(ctypes.c_char_p)(("LlamaJaxProductShape", library))().decode()
        except (OSError, AttributeError) as e:
            problems.append(f"{variant.name}: {path.name} does not load ({e})")
            continue
        if running is not None and (built // 1000 != running // 1000 or built > running):
            problems.append(
                f"{variant.name}: built against XLA FFI {built // 1000}.{built % 1000}, but this jaxlib has"
                f" {running // 1000}.{running % 1000}; reinstall llama-jax to rebuild it"
            )
            continue
        tiles = "amx_tile" in variant.cpu_flags
        disagreement = _disagreement(library, tiles)
        if disagreement is not None:
            problems.append(
                f"{variant.name}: {path.name} {disagreement} (built from another version); reinstall llama-jax to"
                " rebuild it"
            )
            continue
        if tiles and not library.LlamaJaxTilesGranted():
            problems.append(f"{variant.name}: Linux does not grant this process AMX's tile data (ARCH_REQ_XCOMP_PERM)")
            continue
        for symbol in HANDLERS:
            jax.ffi.register_ffi_target(symbol, jax.ffi.pycapsule(getattr(library, symbol)), platform="cpu")
        units = f"; the block products of bf16, {', '.join(sorted(TILE_BLOCKS))} weights on AMX tiles" if tiles else ""
        passed = f"; passed over {'; '.join(problems)}" if problems else ""
        return variant.name, f"the CPU has {'+'.join(variant.cpu_flags)}; block products {shape}{units}{passed}"
    reason = "; ".join(problems)
    print(f"llama-jax: native kernels unavailable ({reason}); running XLA's products", file=sys.stderr)
    return None, reason
