"""The machine's own peaks on the benchmark's threads (benchmarks/peak.cc, compiled here with -O3 -march=native):
f32 FMA GFLOP/s, int8 dot-product Gop/s where the CPU has them, and the read bandwidth from memory in GB/s, for
the engines' figures to be read against (breakdown.py, run.py)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

from engines import THREADS

HERE = Path(__file__).resolve().parent


def peaks() -> dict:
    """{"f32_fma_gflops", "int8_dot_gops" (where there are such units), "read_gbps", "threads"}; {} without a C++
    compiler."""
    binary = Path(tempfile.gettempdir()) / "llama-jax-peak"
    built = subprocess.run(["g++", "-O3", "-march=native", "-pthread", str(HERE / "peak.cc"), "-o", str(binary)])
    if built.returncode:
        return {}
    return json.loads(subprocess.run([str(binary), str(THREADS)], capture_output=True, text=True).stdout)
