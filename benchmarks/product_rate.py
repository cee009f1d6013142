"""The native product's rate alone, in GFLOP/s and as a share of the f32 FMA peak (`machine.py`), at a model's
matrix shapes: what a prefill's products could reach if nothing else ran (issue 53: is an 8B prefill's shortfall
the products or the rest?).

    taskset -c 0,1 .venv/bin/python benchmarks/product_rate.py [--config configs/family/llama-3.1-8b.json]
        [--rows 256] [--held f32,bf16,Q4_K] [--transposed] [--bf16-x]

Per shape of the config's layers (q/o: D x D; k/v: KV x D; gate/up: F x D; down: D x F), x [rows, I] times W
[O, I]ᵀ by `kernels.product` (--transposed: g [rows, O] times W by `kernels.transposed`, a gradient's), jitted, W
random (f32 or bf16, or random Q4_K blocks: tests/gguf_builder.blocks_of_size), the best of 3 timed loops of about
20 GFLOP each. LLAMA_JAX_NATIVE_VARIANT=avx512 on an AMX machine runs bf16 weights on the FMA units instead of the
tiles. --bf16-x: x rounded to bf16 and multiplied as such (the bfloat16 tier's products: one tile term).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the tests' GGUF helpers, from the source tree
sys.path.insert(0, str(HERE))

from machine import peaks  # noqa: E402

from llama_jax import kernels  # noqa: E402
from llama_jax.core.quantized import FORMATS  # noqa: E402
from tests.gguf_builder import blocks_of_size  # noqa: E402


def shapes(config: dict) -> dict[str, tuple[int, int]]:
    d, f = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * config.get("head_dim", d // config["num_attention_heads"])
    return {"q, o": (d, d), "k, v": (kv, d), "gate, up": (f, d), "down": (d, f)}


def weight(held: str, out: int, inner: int):
    if held in ("f32", "bf16"):
        dtype = jnp.float32 if held == "f32" else jnp.bfloat16
        return jnp.asarray(np.random.default_rng(1).standard_normal((out, inner)) * 0.02, dtype)
    ggml_type = gguf.GGMLQuantizationType[held]
    fmt = FORMATS[ggml_type]
    blocks = blocks_of_size((out, inner), ggml_type, 0.02, 1)
    return fmt(jnp.asarray(blocks.reshape(out, inner // fmt.VALUES, fmt.BYTES)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(HERE.parent / "configs" / "family" / "llama-3.1-8b.json"))
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--held", default="f32,Q4_K", help="f32, bf16 and/or ggml types of quantized.FORMATS")
    parser.add_argument("--transposed", action="store_true", help="g · W (a gradient's product) instead of x · Wᵀ")
    parser.add_argument("--bf16-x", action="store_true", help="x's values bf16, one tile term (the bfloat16 tier)")
    args = parser.parse_args()
    peak = peaks()["f32_fma_gflops"]
    print(f"f32 FMA peak {peak:.1f} GFLOP/s; {args.rows} rows; {kernels.status()}")
    if args.bf16_x and args.transposed:
        parser.error("--bf16-x is x · Wᵀ's (the tier's gradients are f32)")
    forward = functools.partial(kernels.product, bf16_x=args.bf16_x)
    multiply = jax.jit(kernels.transposed if args.transposed else forward)
    for name, (out, inner) in shapes(json.loads(Path(args.config).read_text())).items():
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((args.rows, out if args.transposed else inner)), jnp.float32)
        x = x.astype(jnp.bfloat16).astype(jnp.float32) if args.bf16_x else x
        flops = 2 * args.rows * out * inner
        for held in args.held.split(","):
            if held not in ("f32", "bf16") and inner % FORMATS[gguf.GGMLQuantizationType[held]].VALUES:
                print(f"{name:9} {out:6} x {inner:6} {held:5} n/a: {inner} inputs are not whole blocks")
                continue
            w = weight(held, out, inner)
            multiply(w, x).block_until_ready()
            reps, best = max(3, int(2e10 / flops)), float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(reps):
                    y = multiply(w, x)
                y.block_until_ready()
                best = min(best, (time.perf_counter() - start) / reps)
            rate = flops / best / 1e9
            print(f"{name:9} {out:6} x {inner:6} {held:5} {rate:6.1f} GFLOP/s  {100 * rate / peak:4.1f}% of the peak")


if __name__ == "__main__":
    main()
