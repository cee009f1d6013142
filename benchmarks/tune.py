"""Measures the native matrix-vector product's speed parameters (`llama_jax.kernels.tuning`) on this CPU: each
candidate set side by side in one process, in interleaved rounds (this kind of machine's memory-bound timings swing
by 20% or more between runs), on SmolLM2-135M's shapes of Q4_1 rows (30 layers, read from memory as a decode step
reads them) and its Q8_0 head. Prints each candidate's median time per matrix, the chosen set's first; a CPU whose
best set differs from `tuning.chosen()` by more than the spread between rounds wants a row of its own there.

    taskset -c 0,1 .venv/bin/python benchmarks/tune.py [--rounds 11]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax import kernels
from llama_jax.core.quantized import Q4_1, Q8_0, Blocks
from llama_jax.kernels.tuning import MatvecTuning, chosen
from llama_jax.runtime.cpu import cpu_id, l1_data_bytes

LAYERS = 30
CALLS = 60  # products per timed call (layer l % LAYERS)


def random_blocks(fmt: type[Blocks], layers: int, out: int, inputs: int, rng: np.random.Generator) -> Blocks:
    raw = rng.integers(0, 256, size=(layers, out, inputs // fmt.VALUES, fmt.BYTES), dtype=np.uint8)
    raw[..., 0:2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)  # a finite scale
    return fmt(jnp.asarray(raw))


def medians(w: Blocks, batch: int, sets: dict[str, MatvecTuning], rounds: int, rng: np.random.Generator) -> dict:
    """Each set's median seconds per product x · w[l]ᵀ over `rounds` interleaved rounds."""
    x = jnp.asarray(rng.standard_normal((batch, w.shape[-1])), jnp.float32)
    layers = w.shape[0]

    @functools.partial(jax.jit, static_argnums=1)
    def run(x, tuning):
        add = lambda k, total: total + kernels.matvec(w, k % layers, x, tuning).sum()  # noqa: E731
        return jax.lax.fori_loop(0, CALLS, add, jnp.zeros(()))

    times = {name: [] for name in sets}
    for t in sets.values():
        run(x, t).block_until_ready()  # compiled
    for _ in range(rounds):
        for name, t in sets.items():
            start = time.perf_counter()
            run(x, t).block_until_ready()
            times[name].append((time.perf_counter() - start) / CALLS)
    return {name: float(np.median(v)) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    base = chosen().matvec
    print(f"cpu: {cpu_id()}, L1 data {l1_data_bytes()} bytes; chosen: {chosen()}")
    splits = {f"split_bytes={v}": base._replace(split_bytes=v) for v in (base.split_bytes, 0, 1 << 40)}
    aheads = {f"ahead_small={v}": base._replace(ahead_small=v) for v in (base.ahead_small, 0, 1024, 2048, 8192, 16384)}
    items = {f"items_per_thread={v}": base._replace(items_per_thread=v) for v in (base.items_per_thread, 1, 2, 8, 16)}
    cases = [  # (what, matrix, batch, candidates)
        ("Q4_1 1536 x 576, batch 8", random_blocks(Q4_1, LAYERS, 1536, 576, rng), 8, splits),
        ("Q4_1 576 x 1536, batch 8", random_blocks(Q4_1, LAYERS, 576, 1536, rng), 8, splits),
        ("Q4_1 576 x 1536, batch 6", random_blocks(Q4_1, LAYERS, 576, 1536, rng), 6, splits),
        ("Q8_0 head 49152 x 576, batch 8", random_blocks(Q8_0, 1, 49152, 576, rng), 8, splits),
        ("Q4_1 576 x 576, batch 1", random_blocks(Q4_1, LAYERS, 576, 576, rng), 1, aheads | items),
        ("Q4_1 1536 x 576, batch 1", random_blocks(Q4_1, LAYERS, 1536, 576, rng), 1, aheads | items),
        ("Q4_1 576 x 1536, batch 1", random_blocks(Q4_1, LAYERS, 576, 1536, rng), 1, aheads | items),
    ]
    for what, w, batch, sets in cases:
        result = medians(w, batch, sets, args.rounds, rng)
        best = min(result, key=result.get)
        row = "  ".join(f"{name} {seconds * 1e6:.1f}" for name, seconds in result.items())
        print(f"{what} (µs, median of {args.rounds}): {row}  | fastest: {best}")


if __name__ == "__main__":
    main()
