"""The native kernels make progress on any thread pool: the calling thread claims work itself, so a decode step
finishes on a one-thread pool, and one model serves many Python threads at once, each getting what it gets alone."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import llama_jax
from llama_jax import testing
from llama_jax.testing import tiny_config

TINY = "tiny_config(kv=2, g=2, half=8, ffn=64, layers=2, vocab=300)"


def tiny_model(native=None) -> llama_jax.Model:
    return testing.tiny_model(tiny_config(kv=2, g=2, half=8, ffn=64, layers=2, vocab=300), native=native)


def test_generation_finishes_on_a_one_thread_pool():
    """A child process pinned to one core (XLA sizes its intra-op pool from the affinity) generates the same
    tokens as this one, within the time limit."""
    code = textwrap.dedent(f"""
        import os
        os.sched_setaffinity(0, {{min(os.sched_getaffinity(0))}})
        from llama_jax.testing import tiny_config, tiny_model
        m = tiny_model({TINY})
        print(m.native.active, m.generate_ids([5, 6, 7], max_new_tokens=20))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=os.getcwd())
    assert done.returncode == 0, done.stderr
    model = tiny_model()
    assert done.stdout.split(" ", 1)[0] == str(model.native.active)
    assert done.stdout.split(" ", 1)[1].strip() == str(model.generate_ids([5, 6, 7], max_new_tokens=20))


def test_native_off_gives_the_same_tokens():
    on, off = tiny_model(), tiny_model("off")
    assert not off.native.active and "switched off" in off.native.reason
    assert on.generate_ids([5, 6, 7], max_new_tokens=24) == off.generate_ids([5, 6, 7], max_new_tokens=24)


@pytest.mark.slow
def test_one_model_serves_eight_threads_at_once(model):
    """generate, stream and score, greedy and seeded, from 8 Python threads on the same loaded model: each result
    equals the one the same call gives alone, and all finish within the time limit."""
    prompts = ["The capital of France is", "Water boils at", "Once upon a time,", "def fibonacci(n):"]
    calls = []
    for i, prompt in enumerate(prompts):
        calls.append(lambda p=prompt: model.generate(p, max_new_tokens=12))
        calls.append(lambda p=prompt, i=i: "".join(model.stream(p, max_new_tokens=12, temperature=0.8, seed=i)))
    calls[6] = lambda: [s.logprobs.tolist() for s in model.score(prompts, batch_size=2)]
    calls[7] = lambda: model.generate(prompts[:2], max_new_tokens=10, temperature=0.7, top_k=40, seed=11)
    expected = [call() for call in calls]
    results: list = [None] * len(calls)
    errors: list = []

    def work(k):
        try:
            for _ in range(2):
                results[k] = calls[k]()
        except Exception as e:  # reported below with the thread's index
            errors.append((k, e))

    threads = [threading.Thread(target=work, args=(k,), daemon=True) for k in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a thread did not finish within 10 minutes"
    assert not errors, errors
    for k, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert np.array_equal(np.asarray(got, dtype=object), np.asarray(want, dtype=object)), f"call {k}"


def test_the_switch_takes_auto_off_or_require_and_says_why(monkeypatch):
    from llama_jax import InvalidArgumentError, NativeKernelError
    from llama_jax.kernels import library

    monkeypatch.setenv("LLAMA_JAX_NATIVE", "sometimes")
    with pytest.raises(InvalidArgumentError, match=r"LLAMA_JAX_NATIVE=sometimes: .* auto, off, require"):
        library.status()
    with pytest.raises(InvalidArgumentError, match="native='fast'"):
        library.status("fast")
    assert library.status("off").reason == "switched off by native='off'"  # the argument wins over the variable
    monkeypatch.setattr(library, "_load", lambda: (None, "this CPU lacks avx2+fma+f16c"))
    assert str(library.status("auto")) == "XLA's products (this CPU lacks avx2+fma+f16c)"
    with pytest.raises(NativeKernelError, match=r"required .* cannot run here: this CPU lacks avx2"):
        library.status("require")
    with pytest.raises(NativeKernelError):
        tiny_model("require")
