"""Builds llama.cpp (llama-cpp-python) for the benchmark as its users build it: natively first (GGML_NATIVE, every
instruction set the compiler finds on this CPU: AVX-512, VNNI, BF16 and AMX where present), then a smoke test in a
fresh process (the default model loaded, a 64-token prompt decoded, its logits finite and the same across two
runs). Only where that process dies on a signal is llama.cpp rebuilt with explicit flags, dropping extensions in
this order: AMX, then the dot-product and BF16 extensions (AVX512-VNNI, AVX-VNNI, AVX512_BF16, AVX512-VBMI), then
AVX-512 itself; each step is said on stdout. Two deaths are known: an illegal instruction (a virtual machine can
advertise an extension it does not run) and a segmentation fault inside ggml's AMX matrix product on some
Sapphire/Emerald Rapids machines (llama.cpp issue 20824, closed unfixed; it kills the smoke test on the Q4_1
model here). A process that fails without a signal (an assertion, an import error) stops the search: that is a
broken build, not an extension this CPU cannot run. The build that passed, and why the ones before it were
dropped, are written to .venv/llama-cpp-build.json, which benchmarks/run.py reports beside its figures.

    .venv/bin/python benchmarks/build_llama_cpp.py   # (make bench runs it)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
RECORD = Path(sys.prefix) / "llama-cpp-build.json"
PACKAGE = "llama-cpp-python>=0.3"


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def builds(flags: set[str]) -> list[tuple[str, list[str]]]:
    """The builds to try, best first: native, then explicit flags without what may not run here."""
    has = flags.__contains__
    base = {"GGML_AVX": has("avx"), "GGML_AVX2": has("avx2"), "GGML_FMA": has("fma"), "GGML_F16C": has("f16c")}
    base |= {"GGML_BMI2": has("bmi2")}
    avx512 = {"GGML_AVX512": has("avx512f")}
    extras = {"GGML_AVX512_VBMI": has("avx512vbmi"), "GGML_AVX512_VNNI": has("avx512_vnni")}
    extras |= {"GGML_AVX512_BF16": has("avx512_bf16"), "GGML_AVX_VNNI": has("avx_vnni")}
    amx = {"GGML_AMX_TILE": has("amx_tile"), "GGML_AMX_INT8": has("amx_int8"), "GGML_AMX_BF16": has("amx_bf16")}

    def explicit(*parts: dict[str, bool]) -> list[str]:
        chosen = {k: v for part in parts for k, v in part.items()}
        every = base | avx512 | extras | amx
        return ["-DGGML_NATIVE=OFF"] + [f"-D{k}={'ON' if chosen.get(k, False) else 'OFF'}" for k in every]

    candidates = [("native", ["-DGGML_NATIVE=ON"])]
    if any(amx.values()):
        candidates.append(("without AMX", explicit(base, avx512, extras)))
    if any(extras.values()):
        candidates.append(("without VNNI, BF16 and VBMI", explicit(base, avx512)))
    if avx512["GGML_AVX512"]:
        candidates.append(("without AVX-512", explicit(base)))
    return candidates


def install(cmake_args: list[str]) -> None:
    """llama-cpp-python compiled from source with these CMake flags (pip's wheel cache off: it ignores CMAKE_ARGS),
    then whatever it depends on that is missing (nothing else is reinstalled)."""
    env = os.environ | {"CMAKE_ARGS": " ".join(cmake_args), "FORCE_CMAKE": "1"}
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", "--no-cache-dir"]
    subprocess.run([*command, "--no-binary", "llama-cpp-python", PACKAGE], env=env, check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", PACKAGE], check=True)  # its dependencies


SMOKE = """
import numpy as np, sys
sys.path.insert(0, {here!r})
from engines import LlamaCpp
from llama_jax import default_model_path
engine = LlamaCpp(str(default_model_path()))
ids = [(7 * i + 3) % 40000 for i in range(64)]
a, b = engine.first_logits(ids), engine.first_logits(ids)
assert np.isfinite(a).all() and (a == b).all(), "llama.cpp's logits are not finite or not repeatable"
print("ok")
"""


def smoke_test() -> int:
    """The return code of a fresh process that loads the default model in llama.cpp and decodes a prompt."""
    done = subprocess.run([sys.executable, "-c", SMOKE.format(here=str(HERE))], capture_output=True, text=True)
    if done.returncode > 0:
        print(done.stderr[-2000:], file=sys.stderr)
    return done.returncode


def main() -> int:
    flags = cpu_flags()
    dropped: list[str] = []
    for name, cmake_args in builds(flags):
        print(f"llama.cpp: building ({name}: {' '.join(cmake_args)})", flush=True)
        install(cmake_args)
        code = smoke_test()
        if code == 0:
            record = {"build": name, "cmake_args": cmake_args, "dropped": dropped}
            RECORD.write_text(json.dumps(record, indent=1) + "\n")
            print(f"llama.cpp: the {name} build runs here (recorded in {RECORD})")
            return 0
        if code > 0:
            print(f"llama.cpp: the {name} build's smoke test failed (exit {code}); not trying others", file=sys.stderr)
            return 1
        death = signal.Signals(-code).name
        dropped.append(f"{name}: the smoke test died on {death}")
        print(f"llama.cpp: the {name} build dies on {death} here; trying the next")
    print("llama.cpp: no build runs on this CPU", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
