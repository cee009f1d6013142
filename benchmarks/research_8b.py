"""Research on an 8B model held as stored: a Llama-3.1-8B-shaped Q4_K_M file (random weights written as Q8_0 and
requantized by llama.cpp's own quantizer, the real 128,256-token vocabulary and llama3 RoPE as `rope_freqs.weight`:
`weights.stored_file`, kept in benchmarks/.cache/), each task in a fresh process: its seconds (load, then the task
twice: the first call compiles) and the process's peak RSS beside the file's size.

    taskset -c 0,1 .venv/bin/python benchmarks/research_8b.py [--tokens 256] [--tasks activation_grads,...]

Tasks: load (load and one token after a 32-token prompt), activations (`Model.activations`, the layers' outputs),
activation_grads (of a next-token loss, at every layer's output; activation_grads_remat: the layers
rematerialised), activation_grads_all (at every site of every layer, the pattern included), weight_grads (of layer
16's weights, `layers=[16]`), score (the sequence's log-probabilities). Needs llama-cpp-python (`make bench` builds
it) to make the file once.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent / "configs" / "family" / "llama-3.1-8b.json"
TASKS = (
    "load", "activations", "activation_grads", "activation_grads_remat", "activation_grads_all", "weight_grads", "score"
)  # fmt: skip


def next_token_loss(logits):
    """The mean negative log-likelihood of each next token (module level: hashable, compiled once)."""
    import jax
    import jax.numpy as jnp

    ids = jnp.asarray(IDS)
    return -jnp.mean(jax.nn.log_softmax(logits[:-1])[jnp.arange(len(IDS) - 1), ids[1:]])


IDS: list[int] = []


def run_task(path: Path, task: str, tokens: int) -> dict:
    import jax

    import llama_jax
    from llama_jax import research

    IDS[:] = np.random.default_rng(0).integers(0, 128000, tokens).tolist()
    start = time.perf_counter()
    model = llama_jax.load(path)
    loaded = time.perf_counter() - start
    calls = {
        "load": lambda: model.generate_ids(IDS[:32], max_new_tokens=1),
        "activations": lambda: model.activations(IDS, keep="y"),
        "activation_grads": lambda: research.activation_grads(model, IDS, next_token_loss, names="y"),
        "activation_grads_remat": lambda: research.activation_grads(model, IDS, next_token_loss, "y", remat=True),
        "activation_grads_all": lambda: research.activation_grads(model, IDS, next_token_loss, names=True),
        "weight_grads": lambda: research.weight_grads(model, IDS, next_token_loss, layers=[16]),
        "score": lambda: model.score([IDS], batch_size=1),
    }
    seconds = []
    for _ in range(1 if task == "load" else 2):
        start = time.perf_counter()
        jax.block_until_ready(calls[task]())
        seconds.append(time.perf_counter() - start)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"task": task, "load_s": loaded, "seconds": seconds, "peak_rss": rss, "file": path.stat().st_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--task", help=argparse.SUPPRESS)  # the child's
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.task:
        print(json.dumps(run_task(Path(args.path), args.task, args.tokens)))
        return
    from weights import stored_file

    path = stored_file(CONFIG, "Q4_K_M")
    print(f"{path.name}: {path.stat().st_size / 1e9:.2f} GB, {args.tokens} tokens")
    for task in args.tasks.split(","):
        command = [sys.executable, __file__, "--task", task, "--path", str(path), "--tokens", str(args.tokens)]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{task}: failed\n{done.stderr[-3000:]}")
            continue
        r = json.loads(done.stdout.splitlines()[-1])
        calls = " / ".join(f"{s:.1f}" for s in r["seconds"])
        over = (r["peak_rss"] - r["file"]) / 1e9
        print(f"{task:22} load {r['load_s']:5.1f} s, calls {calls} s, peak RSS {r['peak_rss'] / 1e9:5.2f} GB"
              f" (file + {over:.2f} GB)")  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
