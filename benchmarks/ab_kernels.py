"""Two builds' block kernels side by side in one process: this checkout's against another build's library, each
registered as its own FFI target and called in turn, so the machine's drift between processes (5-15% on the 2-core
VMs, more than the effect of most kernel changes) falls on both alike. Checks that both give the same bits, then
prints per shape the medians and their ratio (this build's time over the other's: below 1, this one is faster).

    git archive REV | tar -x -C /tmp/other && (cd /tmp/other && .venv/bin/python setup.py build_ext --inplace)
    taskset -c 0,1 .venv/bin/python benchmarks/ab_kernels.py /tmp/other/llama_jax/kernels/_kernels_avx512*.so \\
        [--kernel attend_block|product] [--reps 21] [--positions 512 2048 8000] [--rows 512] [--held Q4_1]
        [--shapes 14336x4096 4096x14336] [--forward]

attend_block: one layer's causal attention of SmolLM2-135M's heads (9 query, 3 key/value heads of 64) at each
number of positions. product: a layer loop's products (12 distinct layers of each of SmolLM2-135M's matrix shapes,
or of --shapes [O]x[I]; read in place from the stack; both directions, x · Wᵀ and the gradient's x · W, or with
--forward the first alone) of `rows` rows, W held as `held` (random values: float32, or Q4_1's or Q4_K's blocks).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import cpu_name

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' GGUF helpers, from the source tree
from llama_jax import kernels
from llama_jax.core.quantized import FORMATS
from llama_jax.kernels import library
from llama_jax.kernels.tuning import chosen
from tests.gguf_builder import finite_blocks

SHAPES = ((1536, 576), (576, 1536), (576, 576))  # [O, I]: gate and up, down, q and o
LAYERS = 12  # distinct weights a loop reads, as a model's layers (past L3 together, as there)


def alternate(calls: dict[str, object], args: tuple, reps: int) -> dict[str, float]:
    """Each call's median seconds over reps rounds, the calls in turn within a round, after one call each whose
    results must agree to the bit."""
    first = {name: np.asarray(jax.block_until_ready(f(*args))) for name, f in calls.items()}
    results = list(first.values())
    if not all(np.array_equal(results[0], r) for r in results[1:]):
        raise SystemExit(f"the builds' results differ: {list(calls)}")
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, f in calls.items():
            start = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def attend_block_calls(positions: int) -> tuple[dict[str, object], tuple]:
    heads, kv, head = 9, 3, 64
    rng = np.random.default_rng(positions)
    q = jnp.asarray(rng.standard_normal((1, positions, heads, head)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((1, kv, positions, head)), jnp.float32) for _ in range(2))
    pos = jnp.arange(positions, dtype=jnp.int32)[None]

    def call(target: str):
        ffi = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
        return jax.jit(lambda q, k, v, pos: ffi(q, k, v, pos, window=np.int64(0)))

    return {"this": call(library.ATTEND_BLOCK), "other": call("Other" + library.ATTEND_BLOCK)}, (q, k, v, pos)


def stack(held: str, o: int, i: int, rng: np.random.Generator) -> jax.Array:
    """LAYERS matrices [O, I] held as `held`: f32 values, or Q4_1 blocks (f16 d = 0.01, m = -0.05, random quants),
    or Q4_K blocks (random, finite: tests/gguf_builder.finite_blocks)."""
    if held == "float32":
        return jnp.asarray(rng.standard_normal((LAYERS, o, i)), jnp.float32)
    if held == "Q4_K":
        fmt = FORMATS[gguf.GGMLQuantizationType.Q4_K]
        return jnp.asarray(finite_blocks(fmt, (LAYERS, o, i // fmt.VALUES), rng, 0.01))
    blocks = rng.integers(0, 256, size=(LAYERS, o, i // 32, 20), dtype=np.uint8)
    blocks[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    blocks[..., 2:4] = np.frombuffer(np.float16(-0.05).tobytes(), np.uint8)
    return jnp.asarray(blocks)


def product_calls(held: str, o: int, i: int, rows: int, transpose: bool) -> tuple[dict[str, object], tuple]:
    rng = np.random.default_rng(o * i + transpose)
    w = stack(held, o, i, rng)
    n_in, n_out = (o, i) if transpose else (i, o)
    x = jnp.asarray(rng.standard_normal((1, rows, n_in)), jnp.float32)
    attributes = chosen().product.attributes()

    def call(target: str):
        ffi = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((1, rows, n_out), jnp.float32))

        def layer(index, total):  # [1, rows, 1]: each layer's first column, so no layer's product is dropped
            y = ffi(w, index.astype(jnp.int32), x + total * 0, transpose=transpose, **attributes)
            return total + y[..., :1]

        return jax.jit(lambda x: jax.lax.fori_loop(0, LAYERS, layer, jnp.zeros((1, rows, 1), jnp.float32)))

    target = library.PRODUCT[held]
    return {"this": call(target), "other": call("Other" + target)}, (x,)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("other", type=Path, help="the other build's kernel library (_kernels_<variant>*.so)")
    parser.add_argument("--kernel", choices=("attend_block", "product"), default="attend_block")
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--positions", type=int, nargs="+", default=[512, 2048, 8000])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--held", choices=("float32", "Q4_1", "Q4_K"), default="Q4_1")
    parser.add_argument("--shapes", nargs="+", help="[O]x[I] of the products (default SmolLM2-135M's)")
    parser.add_argument("--forward", action="store_true", help="x · Wᵀ alone, not the transposed product too")
    args = parser.parse_args()
    state = kernels.status("auto")  # this build's library loaded, its targets registered
    if not state.active:
        raise SystemExit(f"this build's kernels are not loaded: {state}")
    other = ctypes.CDLL(str(args.other))
    for target in (library.ATTEND_BLOCK, library.PRODUCT[args.held]):
        jax.ffi.register_ffi_target("Other" + target, jax.ffi.pycapsule(getattr(other, target)), platform="cpu")
    print(f"{cpu_name()}; this build against {args.other}, medians of {args.reps} calls each, in turn")
    shapes = [tuple(int(n) for n in shape.split("x")) for shape in args.shapes] if args.shapes else SHAPES
    if args.kernel == "attend_block":
        cases = [(f"{t} positions", attend_block_calls(t), 4 * 9 * 64 * t * (t + 1) / 2) for t in args.positions]
    else:
        cases = [
            (f"{args.held} {o}x{i}{' transposed' if t else ''}, {args.rows} rows",
             product_calls(args.held, o, i, args.rows, t), 2 * args.rows * o * i * LAYERS)
            for o, i in shapes for t in ((False,) if args.forward else (False, True))
        ]  # fmt: skip
    for name, (calls, operands), flops in cases:
        medians = alternate(calls, operands, args.reps)
        rates = {k: flops / s / 1e9 for k, s in medians.items()}
        print(
            f"{name}: {medians['this'] * 1e3:.2f} ms ({rates['this']:.0f} GFLOP/s) against "
            f"{medians['other'] * 1e3:.2f} ms ({rates['other']:.0f}): {medians['this'] / medians['other']:.3f}"
        )


if __name__ == "__main__":
    main()
