"""Compiled executables on disk (`executables`): a warm process loads prefill and decode instead of tracing them,
and anything their code depends on (the config, the shapes, jax's version) misses the cache instead of loading a
wrong executable."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.compilation_cache import compilation_cache

import llama_jax
from llama_jax import testing
from llama_jax.core import kv_cache
from llama_jax.passes import cached, decode_batch
from llama_jax.runtime import executables
from llama_jax.testing import tiny_config
from tests.helpers import COMPILATION_CACHE_ENV

FUNCTIONS = (cached._extend_jit, decode_batch.decode_chunk, kv_cache._zeros)


@pytest.fixture(autouse=True)
def without_jax_s_compilation_cache(monkeypatch):
    """These tests count what llama-jax's executables write and load, so JAX's own compilation cache, which the
    rest of the suite shares (tests/helpers.py), is off here and in the processes they start: a compile it
    answered would leave its executable unwritten (as the last test shows, with a cache of its own). JAX's
    executables in memory are dropped too: one an earlier test in this process read from that cache, serialized
    again, lacks its kernels' code (loading it: "NOT_FOUND: Function wrapped_broadcast not found")."""
    for name in COMPILATION_CACHE_ENV:
        monkeypatch.delenv(name, raising=False)
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()  # JAX decides once whether the cache is used; again after this
    jax.clear_caches()
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


@pytest.fixture
def disk(tmp_path, monkeypatch):
    """A fresh cache folder; each function's in-memory executables dropped before and after."""
    monkeypatch.setenv("LLAMA_JAX_CACHE", str(tmp_path))
    for fn in FUNCTIONS:
        monkeypatch.setattr(fn, "loaded", {})
    executables.COUNTS.clear()
    yield tmp_path
    executables._environment.cache_clear()


def tiny_model(**changes) -> llama_jax.Model:
    return testing.tiny_model(dataclasses.replace(tiny_config(kv=2, g=2, half=4, ffn=32, layers=2), **changes))


def run(model: llama_jax.Model) -> tuple[list[int], dict[str, int]]:
    """A generation, with each function's executables dropped from memory first (as in a new process)."""
    for fn in FUNCTIONS:
        fn.loaded.clear()
    executables.COUNTS.clear()
    out = model.generate_ids([5, 17, 200, 3], 10)
    return out, {key.split(".")[-1]: n for key, n in executables.COUNTS.items()}


def test_a_second_run_loads_what_the_first_compiled(disk):
    model = tiny_model()
    first, counts = run(model)
    assert counts == {"_extend_jit:traced": 1, "decode_chunk:traced": 1, "_zeros:traced": 1}
    second, counts = run(model)
    assert counts == {"_extend_jit:loaded": 1, "decode_chunk:loaded": 1, "_zeros:loaded": 1} and second == first


def test_release_lets_every_executable_go_and_the_next_call_loads_it_from_disk(disk):
    """executables.release() (a long-lived process's code unmapped): no executable left in memory, and the next
    generation loads each one from disk instead of tracing it, to the same tokens."""
    model = tiny_model()
    first, _ = run(model)
    executables.COUNTS.clear()
    executables.release()
    assert not any(fn.loaded for fn in FUNCTIONS)
    assert model.generate_ids([5, 17, 200, 3], 10) == first
    assert {key.split(".")[-1]: n for key, n in executables.COUNTS.items()} == {
        "_extend_jit:loaded": 1, "decode_chunk:loaded": 1, "_zeros:loaded": 1,
    }  # fmt: skip


def test_a_changed_config_misses_the_cache(disk):
    """eps changes no shape: only the key's config tells the executables apart."""
    run(tiny_model())
    _, counts = run(tiny_model(eps=1e-3))
    assert counts == {"_extend_jit:traced": 1, "decode_chunk:traced": 1, "_zeros:loaded": 1}  # the cache's shape


def test_another_jax_version_misses_the_cache(disk, monkeypatch):
    model = tiny_model()
    run(model)
    monkeypatch.setattr(jax, "__version__", "0.0.0-other")
    executables._environment.cache_clear()
    _, counts = run(model)
    assert counts == {"_extend_jit:traced": 1, "decode_chunk:traced": 1, "_zeros:traced": 1}
    assert len(list((disk / "executables").iterdir())) == 2  # one folder per environment


def test_an_unreadable_entry_is_compiled_again(disk):
    model = tiny_model()
    first, _ = run(model)
    for entry in (disk / "executables").rglob("*.bin"):
        entry.write_bytes(b"not an executable")
    again, counts = run(model)
    assert counts == {"_extend_jit:traced": 1, "decode_chunk:traced": 1, "_zeros:traced": 1} and again == first
    third, counts = run(model)
    assert counts == {"_extend_jit:loaded": 1, "decode_chunk:loaded": 1, "_zeros:loaded": 1} and third == first


def test_only_the_most_recent_environments_stay_on_disk(disk, monkeypatch):
    model = tiny_model()
    for i in range(executables.KEEP + 2):
        monkeypatch.setattr(jax, "__version__", f"0.0.{i}")
        executables._environment.cache_clear()
        run(model)
    assert len(list((disk / "executables").iterdir())) == executables.KEEP


def test_with_the_cache_off_nothing_is_written(disk, monkeypatch):
    monkeypatch.setenv("LLAMA_JAX_CACHE", "off")
    _, counts = run(tiny_model())
    assert counts == {} and not (disk / "executables").exists()


WARM_START = """
import dataclasses
import json, sys
import llama_jax
from llama_jax.runtime import executables
model = llama_jax.load()
text = model.generate("The capital of France is", max_new_tokens=12)
print(json.dumps({"text": text, "counts": dict(executables.COUNTS)}))
"""


@pytest.mark.slow
def test_a_warm_process_traces_neither_prefill_nor_decode(tmp_path):
    """The default model in two fresh processes: the second loads every executable the first compiled, and
    generates the same text."""
    env = {**os.environ, "LLAMA_JAX_CACHE": str(tmp_path)}
    runs = []
    for _ in range(2):
        out = subprocess.run(
            [sys.executable, "-c", WARM_START], capture_output=True, text=True, env=env, timeout=300,
            cwd=Path(__file__).parent.parent,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.splitlines()[-1]))
    assert set(runs[0]["counts"]) == {
        "llama_jax.passes.cached._extend_jit:traced",
        "llama_jax.passes.decode_batch.decode_chunk:traced",
        "llama_jax.core.kv_cache._zeros:traced",
    }
    assert set(runs[1]["counts"]) == {
        "llama_jax.passes.cached._extend_jit:loaded",
        "llama_jax.passes.decode_batch.decode_chunk:loaded",
        "llama_jax.core.kv_cache._zeros:loaded",
    }
    assert runs[1]["text"] == runs[0]["text"] != ""


def test_a_call_from_inside_another_traced_function_is_traced_with_it(disk):
    """Inside jit the arguments are tracers: the function is traced into the caller, nothing loaded or written."""
    scale = executables.PersistentJit(lambda x, n: x * n, static_argnames=("n",))
    assert list(jax.jit(lambda y: scale(y, n=3))(jnp.ones(2))) == [3.0, 3.0]
    assert not executables.COUNTS and not (disk / "executables").exists()
    assert list(scale(jnp.ones(2), n=2)) == [2.0, 2.0] and len(list((disk / "executables").rglob("*.bin"))) == 1


WITH_COMPILATION_CACHE = """
import json, sys
from llama_jax.runtime import executables
from llama_jax.runtime.disk import enable_compilation_cache
from llama_jax.testing import tiny_config, tiny_model
enable_compilation_cache(sys.argv[1])
model = tiny_model(tiny_config(kv=2, g=2, half=4, ffn=32, layers=2))
print(json.dumps({"ids": model.generate_ids([5, 17, 200, 3], 10), "counts": dict(executables.COUNTS)}))
"""


def test_an_executable_from_jax_s_compilation_cache_is_not_written(tmp_path):
    """Such an executable does not serialize whole (it fails to run once loaded): with JAX's compilation cache on,
    a process whose compiles that cache answers writes none, and every process generates the same tokens."""
    outs = []
    for run in ("first", "second", "second"):  # the second and third share an executables folder
        env = {**os.environ, "LLAMA_JAX_CACHE": str(tmp_path / run)}
        done = subprocess.run(
            [sys.executable, "-c", WITH_COMPILATION_CACHE, str(tmp_path / "xla")], capture_output=True, text=True,
            env=env, timeout=300, cwd=Path(__file__).parent.parent,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        outs.append(json.loads(done.stdout.splitlines()[-1]))
    assert len(list((tmp_path / "first").rglob("*.bin"))) == 3  # prefill, decode, an empty cache
    assert not list((tmp_path / "second").rglob("*.bin"))
    assert outs[0]["ids"] == outs[1]["ids"] == outs[2]["ids"]
