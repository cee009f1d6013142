"""A file is held at its own size: a Q4_K_M file (the type people download) loaded as stored takes its tensors'
bytes, once, and a process's resident memory up to its first token stays within JAX's own footprint + the file's
tensors + the KV cache + 50 MB. Measured in fresh processes (VmHWM, the peak), as the benchmark's start-up rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest

from llama_jax import LlamaConfig
from llama_jax.testing import hf_shapes
from tests.gguf_builder import GGUF_NAME, gguf_metadata, random_blocks
from tests.helpers import COMPILATION_CACHE_ENV

pytestmark = pytest.mark.slow
MARGIN_MB = 50
# Llama-shaped, 100 MB as Q4_K_M: dim 1024, 8 layers, a 32,000-token vocabulary (the tied embedding a quarter)
CONFIG = LlamaConfig(kv=4, g=4, half=32, ffn=4096, layers=8, vocab=32000, theta=10000.0, context=2048)
Q = gguf.GGMLQuantizationType

PEAK = "int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read()).group(1)) / 1024"  # MiB
JAX_ALONE = f"""
import re
import jax.numpy as jnp
int(jnp.ones(1).sum())
print({PEAK})
"""
FIRST_TOKEN = f"""
import json, re, sys
import llama_jax
from llama_jax.passes.generate import plan_capacity
model = llama_jax.load(sys.argv[1], dtype="stored")
loaded = {PEAK}
prompt = list(range(1, 17))
model.generate_ids(prompt, 1)
c = model.config
kv = 2 * c.layers * c.kvw * plan_capacity(len(prompt), 1, c) * 4 / 2**20  # f32 keys and values, MiB
held = {{kind: size for kind, (_, size) in model.weights.held().items()}}
print(json.dumps({{"loaded": loaded, "first_token": {PEAK}, "kv": kv, "held": held}}))
"""


def q4_k_m(path: Path) -> Path:
    """A file typed as llama.cpp's Q4_K_M types one (random blocks): Q4_K matrices, Q6_K for attn_v and ffn_down
    in the first layers and every third, and for the tied embedding (the LM head)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in gguf_metadata(CONFIG).items():
        vtype = gguf.GGUFValueType.UINT32 if type(value) is int else gguf.GGUFValueType.get_type(value)
        writer.add_key_value(key, value, vtype)
    for seed, (name, shape) in enumerate(hf_shapes(CONFIG).items()):
        file_name = GGUF_NAME[name]
        if len(shape) == 1:
            writer.add_tensor(file_name, np.ones(shape, np.float32))
            continue
        layer = int(file_name.split(".")[1]) if file_name.startswith("blk.") else None
        more_bits = file_name.endswith(("attn_v.weight", "ffn_down.weight")) and (layer < 2 or layer % 3 == 0)
        ggml_type = Q.Q6_K if layer is None or more_bits else Q.Q4_K
        writer.add_tensor(file_name, random_blocks(shape, ggml_type, seed=seed), raw_dtype=ggml_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def run(code: str, *args: str, cache: Path) -> str:
    """The code in a fresh process whose executables are in cache (llama-jax's, without the compilation cache the
    rest of the suite shares: a warm process is one whose executables llama-jax wrote)."""
    env = {k: v for k, v in os.environ.items() if k not in COMPILATION_CACHE_ENV} | {"LLAMA_JAX_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()[-1]


def test_a_k_m_file_is_held_at_its_size_and_its_first_token_within_the_budget(tmp_path):
    """Held: exactly the file's tensor bytes, Q4_K and Q6_K as stored; a load adds about the file to the process;
    the first token of a warm process (its executables on disk, as after install or a first run) peaks within the
    budget. The cold process's peak (compiling) is reported beside it."""
    path = q4_k_m(tmp_path / "k_m.gguf")
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    jax_alone = float(run(JAX_ALONE, cache=tmp_path / "cache"))
    cold = json.loads(run(FIRST_TOKEN, str(path), cache=tmp_path / "cache"))
    warm = json.loads(run(FIRST_TOKEN, str(path), cache=tmp_path / "cache"))
    assert set(warm["held"]) == {"Q4_K", "Q6_K", "float32"}
    assert sum(warm["held"].values()) == file_bytes
    file_mb = file_bytes / 2**20
    budget = jax_alone + file_mb + warm["kv"] + MARGIN_MB
    print(f"JAX alone {jax_alone:.0f} MiB, file {file_mb:.0f} MiB; loaded {warm['loaded']:.0f}, first token warm")
    print(f"{warm['first_token']:.0f} (cold {cold['first_token']:.0f}), budget {budget:.0f} MiB")
    assert warm["loaded"] - jax_alone < file_mb + 40  # the file once, the code and the vocabulary
    assert warm["first_token"] <= budget
