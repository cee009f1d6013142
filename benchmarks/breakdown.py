"""Where a 512-token prefill spends its time: the whole pass beside its parts, each timed alone in the same
process, for llama-jax (XLA) and for PyTorch (the products transformers runs, on MKL/oneDNN); and what batch 8
costs the native decode product against batch 1.

    taskset -c 0,1 .venv/bin/python benchmarks/breakdown.py

Parts: the seven products of every layer (q, k, v, o, gate, up, down at [512, in]), the attention core of every
layer (scores, causal softmax, weighted values), and the norms, RoPE and SwiGLU that remain (the whole minus
the parts). Each part is the median of 7 runs after a warm-up; GFLOP/s counts 2 flops per multiply-add.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engines import THREADS  # noqa: E402
from run import token_ids  # noqa: E402

T = 512
RUNS = 7
PRODUCTS = ("q", "k", "v", "o", "gate", "up", "down")


def median_seconds(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    import llama_jax
    from llama_jax.nn.linear import linear
    from llama_jax.testing import attention

    model = llama_jax.load()
    c, layers = model.config, model.weights.layers
    ids = np.array([token_ids(T)], np.int32)

    def prefill(ids):
        cache = llama_jax.KVCache.empty(c, 1, 1024)
        return llama_jax.prefill(model.weights, cache, ids, c)[0]

    whole = median_seconds(prefill, ids)
    rows = [("whole prefill (jax)", whole, None)]

    x = {n: jnp.ones((1, T, getattr(layers, n).shape[-1]), jnp.float32) for n in PRODUCTS}
    product = jax.jit(linear)
    products, flops = 0.0, 0
    for n in PRODUCTS:
        w = getattr(layers, n)[0]  # [O, I]
        s = median_seconds(product, x[n], w) * c.layers
        products += s
        flops += 2 * T * w.shape[0] * w.shape[1] * c.layers
        rows.append((f"  {n} products x{c.layers} (jax)", s, 2 * T * w.shape[0] * w.shape[1] * c.layers / s))
    rows.append(("  all products (jax)", products, flops / products))

    q = jnp.ones((1, T, c.heads, c.head), jnp.float32)
    kv = jnp.ones((1, c.kv, T, c.head), jnp.float32)
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (1, T, T))
    attend = median_seconds(jax.jit(attention), q, kv, kv, mask) * c.layers
    attention_flops = 4 * T * T * c.heads * c.head * c.layers  # scores and values over the full square
    rows.append((f"  attention core x{c.layers} (jax)", attend, attention_flops / attend))
    rows.append(("  the rest: norms, RoPE, SwiGLU, cache (jax)", whole - products - attend, None))

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        torch.set_num_threads(THREADS)
        tprod, tflops = 0.0, 0
        with torch.inference_mode():
            for n in PRODUCTS:
                w = torch.from_numpy(np.asarray(getattr(layers, n)[0]))
                xt = torch.ones(1, T, w.shape[1])
                s = median_seconds(lambda xt, w: torch.nn.functional.linear(xt, w), xt, w) * c.layers
                tprod += s
                tflops += 2 * T * w.shape[0] * w.shape[1] * c.layers
            rows.append(("  all products (torch)", tprod, tflops / tprod))
            qt = torch.ones(1, c.heads, T, c.head)
            kt = torch.ones(1, c.heads, T, c.head)  # transformers repeats the key/value heads (repeat_kv)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            s = median_seconds(lambda q, k: sdpa(q, k, k, is_causal=True), qt, kt) * c.layers
            rows.append((f"  attention core x{c.layers} (torch sdpa, causal)", s, attention_flops / s))

    if llama_jax.kernels.status().active:
        w = layers.gate  # [L, F, D]: one pass over every layer's gate weights, as a decode step makes
        passes = jax.jit(
            lambda w, x: lax.fori_loop(0, c.layers, lambda i, a: a + llama_jax.kernels.matvec(w, i, x).sum(), 0.0)
        )
        for b in (1, 8):
            s = median_seconds(passes, w, jnp.ones((b, c.dim), jnp.float32))
            name = f"native matvec, gate x{c.layers}, batch {b} ({w.nbytes / s / 1e9:.1f} GB/s)"
            rows.append((name, s, 2 * b * w.size / s))

    width = max(len(r[0]) for r in rows)
    print(f"{'part':<{width}} |     ms | GFLOP/s")
    for name, seconds, rate in rows:
        print(f"{name:<{width}} | {seconds * 1e3:6.1f} | " + ("" if rate is None else f"{rate / 1e9:7.1f}"))


if __name__ == "__main__":
    main()
