"""Long context: one sequence's prefill to its last logits at 512, 2048 and 8000 positions, and batch-1 decode at a
depth of 8000, for llama-jax beside transformers F32 and BF16 (sdpa, PyTorch's fused CPU attention) and llama.cpp,
on the default model (SmolLM2-135M-Instruct, 8192 positions; weights.py's files).

    .venv/bin/python benchmarks/long_context.py [--trials 3] [--only llama-jax] [--json benchmarks/results-long.json]

Each engine runs alone in a process of its own (this script with --engine), one after another, pinned to the same
THREADS cores: a warm-up of every task, then --trials runs; the figure is the median, with the spread. The prompt is
random token ids (a fixed seed), the same for every engine. Decode at depth: 32 greedy tokens after the 8000-token
prompt, the prompt's prefill not counted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engines import THREADS  # noqa: E402
from run import cpu_name  # noqa: E402
from weights import prepare  # noqa: E402

LENGTHS = (512, 2048, 8000)
DEPTH, DEPTH_TOKENS = 8000, 32
ENGINES = ("llama-jax Q4_1", "transformers F32", "transformers BF16", "llama.cpp Q4_1")


def prompt(length: int) -> list[int]:
    return np.random.default_rng(length).integers(10, 49000, length).tolist()


class LlamaJax:
    def __init__(self, _files):
        import llama_jax

        self.llama_jax, self.model = llama_jax, llama_jax.load()

    def prefill(self, ids: list[int]) -> None:
        m = self.model
        cache = self.llama_jax.KVCache.empty(m.config, 1, len(ids))
        ids = np.array([ids], np.int32)
        np.asarray(self.llama_jax.prefill(m.weights, cache, ids, m.config, native=m.native.active)[0])

    def decode(self, ids: list[int], n: int) -> float:
        from llama_jax.passes.generate import token_steps

        m = self.model
        steps = token_steps(m.weights, m.config, [ids], n, native=m.native.active)
        next(steps)  # the prefill and the first token
        start = time.perf_counter()
        for _ in steps:
            pass
        return time.perf_counter() - start


class Transformers:
    def __init__(self, files, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(THREADS)
        self.torch = torch
        directory = files["hf-f32" if dtype == "float32" else "hf-bf16"]
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()

    def prefill(self, ids: list[int]) -> None:
        with self.torch.no_grad():
            self.model(self.torch.tensor([ids]), logits_to_keep=1).logits.float().numpy()

    def decode(self, ids: list[int], n: int) -> float:
        """The seconds of n - 1 greedy steps after the prompt's prefill (timed alone: as generate(n) less
        generate(1), the two 8000-token prefills' noise outweighed the steps, and once made the difference
        negative), each step as `generate` takes it, the cache passed back in."""
        with self.torch.no_grad():
            out = self.model(self.torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            start = time.perf_counter()
            for _ in range(n - 1):
                out = self.model(token, cache=out.cache, use_cache=True)
                token = out.logits[:, -1].argmax(-1, keepdim=True)
            return time.perf_counter() - start


class LlamaCpp:
    def __init__(self, files):
        import llama_cpp as L

        self.L = L
        self.quiet = L.llama_log_callback(lambda level, text, data: None)
        L.llama_log_set(self.quiet, None)
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(files["stored"]).encode(), L.llama_model_default_params())
        params = L.llama_context_default_params()
        params.n_ctx = params.n_batch = DEPTH + DEPTH_TOKENS + 64
        params.n_ubatch, params.n_threads, params.n_threads_batch = 512, THREADS, THREADS
        self.ctx = L.llama_init_from_model(self.model, params)
        self.batch = L.llama_batch_init(params.n_batch, 0, 1)
        self.sampler = L.llama_sampler_init_greedy()

    def _decode(self, ids: list[int], first: int) -> None:
        b = self.batch
        for i, token in enumerate(ids):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, first + i, 1, i == len(ids) - 1
            b.seq_id[i][0] = 0
        b.n_tokens = len(ids)
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def prefill(self, ids: list[int]) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        self._decode(ids, 0)

    def decode(self, ids: list[int], n: int) -> float:
        self.prefill(ids)
        token = self.L.llama_sampler_sample(self.sampler, self.ctx, -1)
        start = time.perf_counter()
        for step in range(n - 1):
            self._decode([token], len(ids) + step)
            token = self.L.llama_sampler_sample(self.sampler, self.ctx, -1)
        return time.perf_counter() - start


def measure(engine: str, trials: int) -> dict[str, list[float]]:
    """Every task of one engine: a warm-up, then `trials` runs; tok/s."""
    files = prepare()
    kind = engine.split()[0]
    runner = {"llama-jax": LlamaJax, "llama.cpp": LlamaCpp}.get(kind)
    made = runner(files) if runner else Transformers(files, "float32" if engine.endswith("F32") else "bfloat16")
    results: dict[str, list[float]] = {}
    for length in LENGTHS:
        ids = prompt(length)
        made.prefill(ids)
        runs = []
        for _ in range(trials):
            start = time.perf_counter()
            made.prefill(ids)
            runs.append(length / (time.perf_counter() - start))
        results[f"prefill tok/s ({length} tokens)"] = runs
    ids = prompt(DEPTH)
    made.decode(ids, DEPTH_TOKENS)
    runs = [(DEPTH_TOKENS - 1) / made.decode(ids, DEPTH_TOKENS) for _ in range(trials)]
    results[f"decode tok/s at depth {DEPTH}"] = runs
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--only", action="append", help="engines whose name starts with this (repeatable)")
    parser.add_argument("--json", default=str(HERE / "results-long.json"))
    parser.add_argument("--engine", help=argparse.SUPPRESS)  # one engine, in this process: its results as JSON
    args = parser.parse_args()
    if args.engine:
        print(json.dumps(measure(args.engine, args.trials)))
        return
    engines = [e for e in ENGINES if not args.only or any(e.startswith(o) for o in args.only)]
    prepare()
    results = {}
    for engine in engines:
        print(f"{engine}...", flush=True)
        done = subprocess.run(
            [sys.executable, __file__, "--engine", engine, "--trials", str(args.trials)],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode != 0:
            print(f"{engine} failed:\n{done.stderr[-2000:]}")
            continue
        results[engine] = json.loads(done.stdout.strip().splitlines()[-1])
    rows = next(iter(results.values())).keys() if results else []
    print(f"\n{cpu_name()}, {THREADS} threads; median (min-max) of {args.trials}")
    print(f"{'':36s}|" + "|".join(f"{e:>24s}" for e in results))
    for row in rows:
        cells = []
        for engine in results:
            runs = results[engine][row]
            cells.append(f"{statistics.median(runs):.1f} ({min(runs):.1f}-{max(runs):.1f})")
        print(f"{row:36s}|" + "|".join(f"{c:>24s}" for c in cells))
    if "llama-jax Q4_1" in results:
        print("\nllama-jax Q4_1's median over each peer's:")
        for row in rows:
            mine = statistics.median(results["llama-jax Q4_1"][row])
            ratios = [f"{e}: {mine / statistics.median(results[e][row]):.2f}" for e in results if e != "llama-jax Q4_1"]
            print(f"{row:36s}  " + ", ".join(ratios))
    Path(args.json).write_text(json.dumps({"machine": cpu_name(), "threads": THREADS, "results": results}, indent=1))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
