"""The instruction-set variants of the native kernels: the sources setup.py finds (llama_jax/kernels/*.cc) compiled
once per variant with its own flags into its own library of every kernel, `_kernels_<name>`, when the package is
built (setup.py reads this file without importing the package). At run time `kernels` loads the
first variant, best first, whose CPU flags the machine has (as /proc/cpuinfo names them); where none fits, XLA's
own products run. A new variant (AVX512_BF16, AMX, ...) is a line here, with any code paths it enables guarded by
the compiler's macros (AVX-512: __AVX512F__; the register width in simd.h, its tiles in matvec.cc and gemm.h).
$LLAMA_JAX_NATIVE_VARIANT=NAME restricts the choice to that variant (to compare them).
"""

from __future__ import annotations

from typing import NamedTuple


class Variant(NamedTuple):
    name: str
    module: str  # the compiled library, named like an extension module of llama_jax.kernels
    compile_flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]  # every one must be in the CPU's flags


VARIANTS: tuple[Variant, ...] = (  # best first; avx512 and avx2 sum in one order (simd.h, matvec.cc, gemm.h): the
    # same bits. amx is avx512 with the block products of bf16 weights on AMX tiles (tiles.h: f32 class in another
    # order, so other bits for those); chosen only where Linux grants the process the tiles' state (library.py)
    Variant(
        "amx",
        "_kernels_amx",
        (
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-mavx512f",
            "-mavx512vnni",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512bf16",
            "-mamx-tile",
            "-mamx-bf16",
        ),
        (
            "avx2",
            "fma",
            "f16c",
            "avx512f",
            "avx512_vnni",
            "avx512bw",
            "avx512vl",
            "avx512_bf16",
            "amx_tile",
            "amx_bf16",
        ),
    ),
    Variant(  # with VNNI (the k-quants' limbs, limbs.h): every AVX-512 CPU since Ice Lake and Zen 4 has it
        "avx512",
        "_kernels_avx512",
        ("-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512vnni"),
        ("avx2", "fma", "f16c", "avx512f", "avx512_vnni"),
    ),
    Variant("avx2", "_kernels_avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
)

# the flags of every variant: exact IEEE f32 (no contraction into FMA beyond the intrinsics, no fast math)
COMMON_FLAGS: tuple[str, ...] = ("-O3", "-g0", "-std=c++17", "-ffp-contract=off", "-fno-fast-math")
