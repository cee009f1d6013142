"""Where a 512-token prefill spends its time: the whole pass beside its parts, each timed alone in the same
process, for llama-jax's default (the stored Q4_1 weights, the native block kernels where they run) beside XLA's
products and PyTorch's (MKL/oneDNN), the machine's own f32 FMA and int8 dot-product peaks and its read bandwidth
(benchmarks/machine.py), and what batch 8 costs the native decode product against batch 1.

    taskset -c 0,1 .venv/bin/python benchmarks/breakdown.py

Parts: the seven products of every layer (q, k, v, o, gate, up, down at [512, in]), the attention core of every
layer (scores, causal softmax, weighted values), and the norms, RoPE and SwiGLU that remain (the whole minus
the parts). Each part is the median of 7 runs after a warm-up; GFLOP/s counts 2 flops per multiply-add, and for
attention the useful (causal) half of the square.
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
from machine import peaks  # noqa: E402
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
    from llama_jax import kernels
    from llama_jax.core.quantized import dense
    from llama_jax.nn.attention import attention_with_pattern, causal_mask
    from llama_jax.nn.linear import linear

    model = llama_jax.load()
    c, layers, native = model.config, model.weights.layers, model.native.active
    ids = np.array([token_ids(T)], np.int32)

    def prefill(ids):
        cache = llama_jax.KVCache.empty(c, 1, 1024)
        return llama_jax.prefill(model.weights, cache, ids, c, native=native)[0]

    whole = median_seconds(prefill, ids)
    rows = [(f"whole prefill ({model.native})", whole, None)]
    first = {n: jax.tree.map(lambda a: a[0], getattr(layers, n)) for n in PRODUCTS}  # layer 0's, as held
    x = {n: jnp.ones((1, T, first[n].shape[-1]), jnp.float32) for n in PRODUCTS}
    paths = {"xla": jax.jit(lambda w, x: linear(x, dense(w)))}
    if native:
        paths = {"native": jax.jit(kernels.product), **paths}
    totals = {}
    for path, product in paths.items():
        products, flops = 0.0, 0
        for n in PRODUCTS:
            w = first[n]
            s, work = median_seconds(product, w, x[n]) * c.layers, 2 * T * w.shape[0] * w.shape[1] * c.layers
            products, flops = products + s, flops + work
            rows.append((f"  {n} products x{c.layers} ({path}, {kernels.kind(w)})", s, work / s))
        rows.append((f"  all products ({path})", products, flops / products))
        totals[path] = products

    q = jnp.ones((1, T, c.heads, c.head_dim), jnp.float32) * jnp.linspace(-1, 1, c.head_dim)
    kv = jnp.ones((1, c.kv, T, c.head_dim), jnp.float32) * jnp.linspace(1, -1, c.head_dim)
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    attention_flops = 2 * T * T * c.heads * c.head_dim * c.layers  # scores and values over the causal half
    xla_attention = jax.jit(lambda q, k, v: attention_with_pattern(q, k, v, causal_mask(positions, T))[0])
    attend = {"xla": median_seconds(xla_attention, q, kv, kv) * c.layers}
    if native:
        attend["native"] = median_seconds(jax.jit(kernels.attend_block), q, kv, kv, positions) * c.layers
    for path, s in attend.items():
        rows.append((f"  attention core x{c.layers} ({path})", s, attention_flops / s))
    ran = "native" if native else "xla"
    rows.append(("  the rest: norms, RoPE, SwiGLU, cache", whole - totals[ran] - attend[ran], None))

    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        torch.set_num_threads(THREADS)
        tprod, tflops = 0.0, 0
        with torch.inference_mode():
            for n in PRODUCTS:
                w = torch.from_numpy(np.array(dense(first[n]).astype(jnp.float32)))
                xt = torch.ones(1, T, w.shape[1])
                s = median_seconds(lambda xt, w: torch.nn.functional.linear(xt, w), xt, w) * c.layers
                tprod += s
                tflops += 2 * T * w.shape[0] * w.shape[1] * c.layers
            rows.append(("  all products (torch)", tprod, tflops / tprod))
            qt = torch.ones(1, c.heads, T, c.head_dim)
            kt = torch.ones(1, c.heads, T, c.head_dim)  # transformers repeats the key/value heads (repeat_kv)
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
            rows.append((name, s, 2 * b * c.layers * w.shape[-2] * w.shape[-1] / s))

    machine = peaks()
    if machine:
        rows.append((f"machine peak, f32 FMA, {THREADS} threads (peak.cc)", 0.0, machine["f32_fma_gflops"] * 1e9))
        for key, units in (
            ("int8_dot_gops", "int8 dot products"),
            ("bf16_dot_gflops", "bf16 dot products"),
            ("amx_bf16_gflops", "AMX bf16 tiles"),
            ("amx_int8_gops", "AMX int8 tiles"),
        ):
            if key in machine:
                rows.append((f"machine peak, {units}, {THREADS} threads", 0.0, machine[key] * 1e9))
        rows.append((f"machine read bandwidth, {THREADS} threads: {machine['read_gbps']:.1f} GB/s", 0.0, None))

    width = max(len(r[0]) for r in rows)
    print(f"{'part':<{width}} |     ms | GFLOP/s")
    for name, seconds, rate in rows:
        print(f"{name:<{width}} | {seconds * 1e3:6.1f} | " + ("" if rate is None else f"{rate / 1e9:7.1f}"))


if __name__ == "__main__":
    main()
