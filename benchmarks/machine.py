"""The machine's own peaks on the benchmark's threads (benchmarks/peak.cc, compiled here with -O3 -march=native):
f32 FMA GFLOP/s, int8 dot-product Gop/s and bf16 dot-product GFLOP/s where the CPU has them, AMX's bf16 and int8
tile products where it has them and grants them, and the read bandwidth from memory in GB/s, for the engines'
figures to be read against (breakdown.py, run.py)."""

from __future__ import annotations

import functools
import json
import subprocess
import tempfile
from pathlib import Path

from engines import THREADS

HERE = Path(__file__).resolve().parent


@functools.cache
def _binary() -> Path | None:
    """peak.cc compiled for this machine (once a process), or None without a C++ compiler."""
    binary = Path(tempfile.gettempdir()) / "llama-jax-peak"
    built = subprocess.run(["g++", "-O3", "-march=native", "-pthread", str(HERE / "peak.cc"), "-o", str(binary)])
    return None if built.returncode else binary


def peaks() -> dict:
    """{"f32_fma_gflops", "int8_dot_gops", "bf16_dot_gflops", "amx_bf16_gflops", "amx_int8_gops" (where there are
    such units), "read_gbps", "threads"}; {} without a C++ compiler."""
    binary = _binary()
    if binary is None:
        return {}
    return json.loads(subprocess.run([str(binary), str(THREADS)], capture_output=True, text=True).stdout)


def read_gbps() -> float | None:
    """The read bandwidth from memory alone (~1 s), GB/s on the benchmark's threads: run.py measures it in every
    trial beside the decode rows, as this machine's bandwidth moves by 10-30% over minutes (other tenants)."""
    binary = _binary()
    if binary is None:
        return None
    out = subprocess.run([str(binary), str(THREADS), "read"], capture_output=True, text=True).stdout
    return json.loads(out)["read_gbps"]
