"""The activation store's throughput and memory: `research.collect` beside the same forward without storage.

    taskset -c 0,1 .venv/bin/python benchmarks/store.py [--batches 20] [--sites y.6] [--rounds 3]

Rows: tokens/s of the forward alone (the jitted pass `collect` runs, `site_values`, on the same padded batches,
its outputs left on the device), of `collect` (tokenizing, the pass, the rows to the host, the shards written
and flushed to disk), their ratio per round, and the peak RSS of a fresh process collecting 1 batch and
--batches batches (the memory bound: it should not grow with the data set). Texts of 60-250 tokens made of
random words (fixed seed); batch 8; the default model as stored.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BATCH = 8
_TEXT = (
    "the of and to in is was for on that with as by at from his her they be this which or are an had not but"
    " what all were when we there can been has more if will one would no out so into their time only new some"
    " could these two may first then do any like my now over such our man me even most made after also did many"
    " river mountain engine theory market garden music winter history language science village ocean animal"
)
WORDS = _TEXT.split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, int(rng.integers(60, 250)))) for _ in range(n)]


def forward_alone(model, data: list[str], sites: list[str]) -> float:
    """tokens/s of site_values over the same padded batches as collect, outputs kept on the device."""
    import jax.numpy as jnp

    from llama_jax.core.buckets import bucket, padded_block
    from llama_jax.research.collect import site_values
    from llama_jax.research.store import parse_sites

    sources = tuple((s.source, s.layer) for s in parse_sites(sites, model.config))
    ids = [model.tokenizer.encode(t) for t in data]
    blocks = []
    for start in range(0, len(ids), BATCH):
        chunk = ids[start : start + BATCH]
        blocks.append(jnp.asarray(padded_block(chunk, bucket(max(map(len, chunk)), model.config.context), BATCH)))
    native = model.native.active
    for block in {b.shape: b for b in blocks}.values():  # compile each bucket first
        site_values(model.weights, block, model.config, sources, "float32", native)[0].block_until_ready()
    start = time.perf_counter()
    outs = [site_values(model.weights, block, model.config, sources, "float32", native) for block in blocks]
    for out in outs:
        out[0].block_until_ready()
    return sum(map(len, ids)) / (time.perf_counter() - start)


def collected(model, data: list[str], sites: list[str], folder: Path) -> float:
    from llama_jax import research

    start = time.perf_counter()
    store = research.collect(model, data, sites, folder, batch_size=BATCH, progress=False)
    return store.tokens / (time.perf_counter() - start)


def peak_rss(batches: int, sites: list[str]) -> float:
    """The peak RSS (MB) of a fresh process that loads the model and collects `batches` batches."""
    code = (
        "import json, resource, sys, tempfile; sys.path.insert(0, 'benchmarks'); import store, llama_jax;"
        " from llama_jax import research; m = llama_jax.load();"
        f" research.collect(m, store.texts({batches * BATCH}), {sites!r}, tempfile.mkdtemp(), batch_size={BATCH},"
        " progress=False); print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--sites", nargs="+", default=["y.6"])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from run import cpu_name  # the CPU of every figure

    import llama_jax

    model = llama_jax.load()
    data = texts(args.batches * BATCH)
    print(f"CPU: {cpu_name()}; {model!r}")
    print(f"sites {args.sites}, {len(data)} texts in batches of {BATCH}, float32 rows")
    with tempfile.TemporaryDirectory() as root:
        collected(model, data[:BATCH], args.sites, Path(root) / "warm")  # compiles what the rounds run
        rows = []
        for r in range(args.rounds):
            alone = forward_alone(model, data, args.sites)
            stored = collected(model, data, args.sites, Path(root) / f"round{r}")
            rows.append((alone, stored))
            print(f"round {r}: forward alone {alone:.0f} tok/s, collect {stored:.0f} tok/s, ratio {stored / alone:.3f}")
    one, many = peak_rss(1, args.sites), peak_rss(args.batches, args.sites)
    print(f"peak RSS: 1 batch {one:.1f} MB, {args.batches} batches {many:.1f} MB")
    ratios = [s / a for a, s in rows]
    print(json.dumps({"ratios": [round(x, 3) for x in ratios], "rss_1": one, f"rss_{args.batches}": many}))


if __name__ == "__main__":
    main()
