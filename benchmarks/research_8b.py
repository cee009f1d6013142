"""Research on an 8B model held as stored: a Llama-3.1-8B-shaped Q4_K_M file (random weights written as Q8_0 and
requantized by llama.cpp's own quantizer, the real 128,256-token vocabulary and llama3 RoPE as `rope_freqs.weight`:
`weights.stored_file`, kept in ~/.cache/llama-jax-bench/), each task in a fresh process: its seconds (load, then
the task twice: the first call compiles) and the process's peak RSS beside the file's size.

    taskset -c 0,1 .venv/bin/python benchmarks/research_8b.py [--tokens 256] [--tasks activation_grads,...]

Tasks: load (load and one token after a 32-token prompt), activations (`Model.activations`, the layers' outputs),
activation_grads (of a next-token loss, at every layer's output; activation_grads_remat: the layers
rematerialised), activation_grads_all (at every site of every layer, the pattern included), weight_grads (of layer
16's weights, `layers=[16]`), score (the sequence's log-probabilities), lm_eval (lm-eval's loglikelihood requests,
the capital questions of examples/tasks/capitals.jsonl under one phrasing, and loglikelihood_rolling of 8 texts of
--tokens tokens, through `llama_jax.lm_eval`), store (`research.collect` of --sequences random sequences of 128
tokens at --site into a store in $TMPDIR, batch 8: the process is killed (SIGKILL) once half of them are stored and
a fresh one resumes the same call; the peak RSS of each, polled from /proc while the first runs, and the rows the
store ends with). `collect` runs the layers up to the deepest site asked for: a shallow site makes the 1,000
sequences minutes, not hours, and --site y.31 takes every layer. Needs llama-cpp-python (`make bench` builds it) to
make the file once.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CONFIG = HERE.parent / "configs" / "family" / "llama-3.1-8b.json"
TASKS = (
    "load", "activations", "activation_grads", "activation_grads_remat", "activation_grads_all", "weight_grads",
    "score", "lm_eval", "store",
)  # fmt: skip
STORE_TOKENS = 128  # the length of each sequence the store task collects


def next_token_loss(logits):
    """The mean negative log-likelihood of each next token (module level: hashable, compiled once)."""
    import jax
    import jax.numpy as jnp

    ids = jnp.asarray(IDS)
    return -jnp.mean(jax.nn.log_softmax(logits[:-1])[jnp.arange(len(IDS) - 1), ids[1:]])


IDS: list[int] = []


def lm_eval_requests(tokens: int) -> tuple[list, list]:
    """lm-eval's loglikelihood requests (a capital question under one phrasing, each of its 4 choices) and
    loglikelihood_rolling requests (8 texts of random words, about `tokens` tokens each)."""
    from lm_eval.api.instance import Instance

    rows = [json.loads(line) for line in (HERE.parent / "examples" / "tasks" / "capitals.jsonl").open()]
    choices = [
        Instance("loglikelihood", {}, (f"Question: What is the capital of {r['country']}?\nAnswer:", " " + c), 0)
        for r in rows
        for c in r["choices"]
    ]
    sys.path.insert(0, str(HERE))
    from store import texts

    rolling = [Instance("loglikelihood_rolling", {}, (" ".join(t.split()[:tokens]),), 0) for t in texts(8)]
    return choices, rolling


def collect_child(path: Path, out: Path, site: str, sequences: int) -> dict:
    """The store task's process: collect (resuming what out holds) and report the store's rows."""
    import llama_jax
    from llama_jax import research

    ids = np.random.default_rng(0).integers(0, 128000, (sequences, STORE_TOKENS)).tolist()
    start = time.perf_counter()
    store = research.collect(llama_jax.load(path), ids, site, out, batch_size=8, progress=False)
    rows = store.rows if store.complete else None
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": time.perf_counter() - start, "rows": rows, "peak_rss": rss}


def peak_rss_of(pid: int) -> int:
    """A running process's peak RSS (bytes), from /proc (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def store_task(path: Path, site: str, sequences: int) -> None:
    """Collects `sequences` sequences at `site`, killed once half are stored, then resumed by a fresh process."""
    out = Path(tempfile.mkdtemp(prefix="llama-jax-store-8b-")) / "store"
    command = [sys.executable, __file__, "--task", "collect", "--path", str(path), "--site", site, "--out", str(out)]
    command += ["--sequences", str(sequences)]
    start, first = time.perf_counter(), subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    peak, stored = 0, 0
    while first.poll() is None and stored < sequences // 2:
        time.sleep(0.5)
        peak = max(peak, peak_rss_of(first.pid))
        manifest = out / "manifest.json"
        if manifest.exists():
            stored = json.loads(manifest.read_text())["cursor"]["input"]
    if first.poll() is not None:
        print(f"store: the first process ended before it was killed ({first.returncode})")
        return
    first.send_signal(signal.SIGKILL)
    first.wait()
    killed = time.perf_counter() - start
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"store: the resumed process failed\n{done.stderr[-3000:]}")
        return
    r = json.loads(done.stdout.splitlines()[-1])
    size, held = sum(f.stat().st_size for f in out.iterdir()), path.stat().st_size
    print(f"store {site}: {sequences} x {STORE_TOKENS} tokens; killed after {killed:.0f} s with {stored} stored,"
          f" peak RSS {peak / 1e9:.2f} GB (file + {(peak - held) / 1e9:.2f} GB); resumed {r['seconds']:.0f} s,"
          f" peak RSS {r['peak_rss'] / 1e9:.2f} GB (file + {(r['peak_rss'] - held) / 1e9:.2f} GB);"
          f" {r['rows']} rows, {size / 1e9:.2f} GB on disk")  # fmt: skip
    shutil.rmtree(out.parent)


def run_task(path: Path, task: str, tokens: int) -> dict:
    import jax

    import llama_jax
    from llama_jax import research

    IDS[:] = np.random.default_rng(0).integers(0, 128000, tokens).tolist()
    start = time.perf_counter()
    if task == "lm_eval":  # lm-eval's model loads the file itself
        import llama_jax.lm_eval

        lm, (choices, rolling) = llama_jax.lm_eval.LlamaJaxLM(str(path), batch_size=8), lm_eval_requests(tokens)
        model = lm.model
    else:
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
        "lm_eval": lambda: (lm.loglikelihood(choices, True), lm.loglikelihood_rolling(rolling, True)),
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
    parser.add_argument("--sequences", type=int, default=1000, help="the store task's sequences of 128 tokens")
    parser.add_argument("--site", default="y.2", help="the site the store task collects")
    parser.add_argument("--task", help=argparse.SUPPRESS)  # the child's
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.task == "collect":
        print(json.dumps(collect_child(Path(args.path), Path(args.out), args.site, args.sequences)))
        return
    if args.task:
        print(json.dumps(run_task(Path(args.path), args.task, args.tokens)))
        return
    from weights import stored_file

    path = stored_file(CONFIG, "Q4_K_M")
    print(f"{path.name}: {path.stat().st_size / 1e9:.2f} GB, {args.tokens} tokens")
    for task in args.tasks.split(","):
        if task == "store":
            store_task(path, args.site, args.sequences)
            continue
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
