"""The benchmark: llama-jax beside transformers (PyTorch CPU) and llama.cpp (llama-cpp-python), on the same
weights (SmolLM2-135M-Instruct) and prompts, in one run, interleaved.

    .venv/bin/python benchmarks/run.py [--trials 5] [--only llama-jax] [--json benchmarks/results.json]
        [--baseline DIR]   # also llama-jax Q4_1 and F32 from another source tree (e.g. a worktree of the last commit)
        [--model 1.7b]     # the 1.7B shape (configs/smollm2-1.7b.json), random weights: see below
        [--file-type Q4_K_M]  # with --model: the random weights quantized by llama.cpp (Q4_K_M, Q8_0; default Q4_1)

Every engine runs in its own worker process, all pinned to the same cores; the runner asks them in turn, one
task at a time, so no two measure at once and drift hits every engine alike. Each figure is the median of
--trials runs after one warm-up, with the spread (min-max). Start-up is measured by fresh processes: cold (llama-
jax's caches empty), and for llama-jax warm (the serialized executables and compilations of the cold run). The
fidelity row: max |logit - transformers F32's| after the 512-token prompt. llama.cpp is driven through
llama-cpp-python's low-level API as its own tools drive it (engines.py), and skipped, with a message, when
llama-cpp-python is not installed (pip install -e '.[bench]'). The machine's read bandwidth from memory
(machine.py) is measured in every trial just before its batch-1 decodes (it moves by 10-30% over minutes here),
and each engine's batch-1 decode is shown as the bytes of weights it reads a second and as its share of that
trial's bandwidth.

--model 1.7b: the same engines on a model of SmolLM2-1.7B's shape, random weights written once as a Q4_1 GGUF
(weights.py; ~22 GB in ~/.cache/llama-jax-bench/ with the F32 and BF16 copies made from it), --json default
benchmarks/results-1.7b.json. Their memory allows one engine at a time: each is loaded, measured (warm-up,
--trials trials) and closed before the next, transformers F32 first (its logits are the fidelity reference).
Every task but the start-up runs, and the ratios of llama-jax's medians on the stored file to its peers'.
--model llama-3.2-1b: Llama-3.2-1B's shape (configs/family/llama-3.2-1b.json): its 128,256-token vocabulary
(llama.cpp's ggml-vocab-llama-bpe.gguf) and llama3 RoPE (llama.cpp's rope_freqs tensor in the GGUF files, the
config's rope_scaling in transformers' directories).
--model qwen3-0.6b, smollm3-3b: the shapes of Qwen3-0.6B (per-head q/k norms, head 128 beside a 1024-wide model,
llama.cpp's qwen2 vocabulary of 151,936 tokens) and SmolLM3-3B (RoPE skipped in every fourth layer, llama-bpe's
128,256), each written under its own GGUF architecture as llama.cpp's converter writes it.
--model also takes a Hugging Face config.json of another shape of these families (llama, qwen2, qwen3, smollm3,
granite; a vocabulary of the default model's size or of one of llama.cpp's vocabulary files; no RoPE scaling or
llama3's).
--file-type Q4_K_M or Q8_0 (with --model): the file llama-jax and llama.cpp compute on as stored is the random
weights quantized by llama.cpp's own quantizer to that type (weights.py), the F32/BF16 engines run on its
dequantized values; the engines are named "llama-jax Q4_K_M", "llama.cpp Q4_K_M". Only the files of the engines
that run (--only) are made.
--model llama-3.1-8b --file-type Q4_K_M (`make bench`): Llama-3.1-8B's shape, 4.9 GB as stored. A model whose F32
weights would take more than half the machine's memory (32 GB here) runs the stored file's engines alone
(llama-jax and llama.cpp on it; no F32/BF16 copies are made), both loaded at once and interleaved as for the
default model, with the start-up runs, and scoring on 2 x 256 tokens.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engines import NEW_TOKENS, THREADS  # noqa: E402
from machine import peaks, read_gbps  # noqa: E402
from weights import prepare, weight_bytes  # noqa: E402

MODELS = {  # None: the default model's file
    "135m": None,
    "1.7b": HERE.parent / "configs" / "smollm2-1.7b.json",
    "llama-3.2-1b": HERE.parent / "configs" / "family" / "llama-3.2-1b.json",
    "llama-3.1-8b": HERE.parent / "configs" / "family" / "llama-3.1-8b.json",
    "qwen3-0.6b": HERE.parent / "configs" / "family" / "qwen3-0.6b.json",
    "smollm3-3b": HERE.parent / "configs" / "family" / "smollm3-3b.json",
}
FILE_TYPES = ("Q4_1", "Q4_K_M", "Q8_0")  # the stored file's type (weights.prepare)


def engine_table(file_type: str) -> dict[str, tuple[str, str]]:
    """name: (engine, weights), the stored file's engines named by its type."""
    return {
        f"llama-jax {file_type}": ("llama-jax:stored", "llama-jax"),  # the file's own blocks, as their exact values
        "llama-jax F32": ("llama-jax:float32", "llama-jax"),
        "llama-jax BF16": ("llama-jax:bfloat16", "llama-jax"),
        "llama-jax bf16 tier": ("llama-jax:bfloat16-tier", "llama-jax"),  # bf16 weights, activations rounded
        "transformers F32": ("transformers:float32", "hf-f32"),
        "transformers BF16": ("transformers:bfloat16", "hf-bf16"),
        "llama.cpp F32": ("llama.cpp:F32", "gguf-f32"),
        "llama.cpp BF16": ("llama.cpp:BF16", "gguf-bf16"),
        f"llama.cpp {file_type}": (f"llama.cpp:{file_type}", "stored"),
    }


REFERENCE = "transformers F32"
FIDELITY = "max |logit - transformers F32|"
BATCH1 = "decode tok/s (batch 1)"
READ = "decode batch 1, weights read GB/s"  # tok/s times the bytes of weights a step reads (weights.weight_bytes)
BANDWIDTH = "read bandwidth, GB/s (machine.py)"  # measured in each trial, before its batch-1 decodes
SHARE = "decode batch 1, % of read bandwidth"  # READ over the same trial's BANDWIDTH
PREFILL, SCORING = "prefill tok/s (512 tokens)", "scoring tok/s ({} x 256)"
PEAK_SHARE = {  # a task's products' flops a second (flops_per_token) over the f32 FMA peak (machine.py)
    PREFILL: ("prefill 512, % of the f32 FMA peak", 512, False),
    SCORING: ("scoring, % of the f32 FMA peak", 256, True),
}
START_ROWS = [
    "start to first token, s (cold)",
    "start to first token, s (warm caches)",
    "peak RSS, MB (first token)",
    "peak RSS, MB (first token, warm)",
    "peak RSS budget, MB (JAX alone + weights + KV cache + 50)",
]
KV_CAPACITY = 1024  # the slots of the KV cache engines.py's llama-jax allocates for the first token
PEERS = ("llama-jax F32", "llama.cpp F32", "transformers F32", "transformers BF16")  # the ratios' (--model), and
# llama.cpp on the stored file
CORES = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:THREADS])
# seconds between two engines' tasks: the last one's threads stop spinning (OpenMP's, ggml's and XLA's pools
# busy-wait a while after their work) before the next one is timed
SETTLE = 1.0
TEXT = (
    "The history of the Roman Empire spans many centuries, beginning with the founding of the city of Rome and "
    "ending with the fall of Constantinople in 1453. Over this long period the empire saw remarkable achievements "
    "in law, engineering, architecture and government, as well as long stretches of civil war, plague and "
    "economic crisis that tested its institutions. "
)


def token_ids(n: int, offset: int = 0) -> list[int]:
    from llama_jax import Tokenizer, default_model_path
    from llama_jax.loaders.gguf_file import GGUFFile

    tok = Tokenizer.from_gguf(GGUFFile(default_model_path()).metadata, "default")
    ids = tok.encode(TEXT * (2 + (n + offset) // 50))
    return ids[offset : offset + n]


def command(script: str, engine: str, path: Path | None, *args: str) -> list[str]:
    """script run for engine on path (None: llama-jax's default model, given as ""), pinned to the cores."""
    return ["taskset", "-c", CORES, sys.executable, str(HERE / script), engine, str(path or ""), *args]


class Worker:
    def __init__(self, engine: str, path: Path | None, env: dict):
        self.proc = subprocess.Popen(
            command("worker.py", engine, path),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=os.environ | {"TOKENIZERS_PARALLELISM": "0"} | env,
        )
        assert json.loads(self.proc.stdout.readline())["ready"]

    def ask(self, **request) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def start_up(engine: str, path: Path | None, env: dict) -> tuple[float, float]:
    """Seconds from spawning a fresh process to its first token, and that process's peak RSS (MB)."""
    start = time.perf_counter()
    out = subprocess.run(
        command("first_token.py", engine, path, json.dumps(token_ids(16))),
        capture_output=True,
        text=True,
        env=os.environ | env,
        check=True,
    )
    seconds = time.perf_counter() - start
    return seconds, json.loads(out.stdout.splitlines()[-1])["peak_rss_mb"]


def llama_jax_width(engine: str) -> int | None:
    """The bytes an element llama-jax's engine holds its weights in: 4 (f32), 2 (bf16), None (as stored)."""
    return {"float32": 4, "bfloat16": 2, "bfloat16-tier": 2}.get(engine.split(":")[1])


def layer_weights(c: dict) -> int:
    """The weights of one layer's matrices (q, k, v, o, gate, up, down) of a Llama config.json."""
    d, head = c["hidden_size"], c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return (
        2 * d * c["num_attention_heads"] * head
        + 2 * d * c["num_key_value_heads"] * head
        + 3 * d * c["intermediate_size"]
    )


def f32_bytes(config: Path) -> int:
    """The bytes of a Llama config's weights in f32 (embedding, untied head, every layer's matrices)."""
    c = json.loads(config.read_text())
    vocabulary = c["vocab_size"] * c["hidden_size"] * (1 if c.get("tie_word_embeddings", True) else 2)
    return 4 * (vocabulary + c["num_hidden_layers"] * layer_weights(c))


def flops_per_token(config: Path, length: int, every_logit: bool) -> float:
    """The flops (2 a multiply-add) of the products a token of a `length`-token sequence costs: every layer's
    matrices, attention's two products over the length / 2 positions a causal token sees on average, and the LM
    head, for every token where every logit is computed (scoring), else once a sequence (prefill)."""
    c = json.loads(config.read_text())
    head = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    attention = 2 * length * c["num_attention_heads"] * head  # q·k and p·v, length / 2 positions each
    lm_head = 2 * c["vocab_size"] * c["hidden_size"] / (1 if every_logit else length)
    return c["num_hidden_layers"] * (2 * layer_weights(c) + attention) + lm_head


def kv_cache_bytes(config: Path) -> int:
    """The f32 keys and values of KV_CAPACITY slots for one sequence, every layer."""
    c = json.loads(config.read_text())
    head = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * KV_CAPACITY * head * 4


def llama_cpp_build() -> str:
    """How llama.cpp was built for this run (benchmarks/build_llama_cpp.py's record), or why it is unknown."""
    record = Path(sys.prefix) / "llama-cpp-build.json"
    if not record.exists():
        return "not built by benchmarks/build_llama_cpp.py (flags unknown)"
    data = json.loads(record.read_text())
    dropped = "".join(f"; {reason}" for reason in data.get("dropped", []))
    return f"{data['build']} ({' '.join(data['cmake_args'])}){dropped}"


def cpu_name() -> str:
    """The CPU (its family and model numbers tell its generation: AMD family 25 model 17 is a Zen 4) and its vector
    extensions (what the kernels can use), as `llama_jax.runtime.cpu` reads them."""
    from llama_jax.runtime.cpu import cpu_flags, cpu_id

    cpu = cpu_id()
    if cpu is None:
        return platform.processor() or platform.machine()
    vector = sorted(f for f in cpu_flags() or () if f.startswith(("avx", "fma", "amx")))
    return f"{cpu} ({' '.join(vector)})"


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


def trials(workers: dict[str, Worker], tasks: dict[str, tuple[dict, int]], count: int) -> dict[str, dict]:
    """Every worker's tok/s at every task, count trials after one warm-up (compilation, caches) that is not
    counted; in each trial the tasks in turn, each asked of every worker in turn (the order rotated a place each
    trial, so that no engine always follows the same one or the bandwidth measurement), SETTLE seconds apart; and
    under BANDWIDTH the machine's read bandwidth at the start of each counted trial (while the workers wait), where
    it can be measured."""
    runs: dict[str, dict[str, list[float]]] = {name: {t: [] for t in tasks} for name in workers}
    names = list(workers)
    for trial in range(count + 1):
        print(f"trial {trial}/{count}", flush=True)
        gbps = read_gbps() if trial else None
        if gbps is not None:
            for name in workers:
                runs[name].setdefault(BANDWIDTH, []).append(gbps)
        order = names[trial % len(names) :] + names[: trial % len(names)]
        for task, (request, tokens) in tasks.items():
            for name in order:
                time.sleep(SETTLE)
                seconds = workers[name].ask(**request)["seconds"]
                if trial:
                    runs[name][task].append(tokens / seconds)
    return runs


def logits(worker: Worker, ids: list[int]) -> np.ndarray:
    return np.asarray(worker.ask(task="logits", ids=ids)["logits"])


def finish(worker: Worker, runs: dict[str, list[float]], ids: list[int], expected: np.ndarray | None) -> dict:
    """A worker's last figures, then it is closed: its fidelity (its logits after ids against expected, where
    there are expected logits), its runs' summaries, its peak RSS over the whole run."""
    result = {}
    if expected is not None:
        result[FIDELITY] = summary([float(np.abs(logits(worker, ids) - expected).max())])
    result |= {task: summary(values) for task, values in runs.items()}
    result["peak RSS, MB (whole run)"] = summary([worker.ask(task="rss")["peak_rss_mb"]])
    worker.close()
    return result


def ratios(results: dict[str, dict], tasks: list[str], file_type: str) -> dict[str, dict[str, float | None]]:
    """llama-jax's median tok/s on the stored file over each peer's (PEERS and llama.cpp on the same file), per
    task (None where either was not run)."""
    ours = results.get(f"llama-jax {file_type}", {})
    return {
        task: {
            peer: ours[task]["median"] / results[peer][task]["median"] if task in ours and peer in results else None
            for peer in (*PEERS, f"llama.cpp {file_type}")
        }
        for task in tasks
    }


def print_row(label: str, cells: list[str], width: int) -> None:
    print(f"{label:<{width}}" + "".join(f" | {c:>22}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--only", action="append", help="engines whose name starts with this (repeatable)")
    parser.add_argument("--json", help="default benchmarks/results.json (--model 135m), else results-MODEL.json")
    parser.add_argument("--baseline", help="a llama-jax source tree to run as 'baseline Q4_1/F32/BF16' beside this one")
    parser.add_argument("--model", default="135m", help=f"{', '.join(MODELS)} or a config.json (random weights)")
    parser.add_argument("--file-type", default="Q4_1", choices=FILE_TYPES, help="the stored file's (with --model)")
    args = parser.parse_args()
    stored, table = f"llama-jax {args.file_type}", engine_table(args.file_type)

    config = MODELS[args.model] if args.model in MODELS else Path(args.model)
    model = args.model if args.model in MODELS else config.stem
    if args.file_type != "Q4_1":
        model = f"{model}-{args.file_type.lower()}"
    json_path = args.json or str(HERE / ("results.json" if config is None else f"results-{model}.json"))
    engines = {n: e for n, e in table.items() if not args.only or any(n.startswith(o) for o in args.only)}
    envs = {name: {} for name in engines}  # a baseline imports llama_jax from its own tree
    if args.baseline:
        for kind in (args.file_type, "F32", "BF16"):
            if f"llama-jax {kind}" in engines:  # beside each llama-jax engine that runs
                engines[f"baseline {kind}"] = table[f"llama-jax {kind}"]
                envs[f"baseline {kind}"] = {"PYTHONPATH": str(Path(args.baseline).resolve())}
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama-cpp-python is not installed: the llama.cpp columns are skipped (pip install -e '.[bench]')")
        engines = {n: e for n, e in engines.items() if not n.startswith("llama.cpp")}
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    stored_only = config is not None and f32_bytes(config) > memory / 2  # the stored file's engines alone
    if stored_only:
        print(f"{model}: F32 weights of {f32_bytes(config) / 1e9:.0f} GB, the machine has {memory / 1e9:.0f} GB: only"
              " the stored file's engines run")  # fmt: skip
        engines = {n: e for n, e in engines.items() if n.endswith(args.file_type)}
    machine = peaks()  # before any engine runs
    paths = prepare(config, args.file_type, {key for _, key in engines.values()})
    prompt16, prompt512 = token_ids(16), token_ids(512)
    batch8 = [token_ids(16, offset=7 * b) for b in range(8)]
    scoring = [token_ids(256, offset=13 * b) for b in range(2 if stored_only else 8)]
    tasks = {
        BATCH1: ({"task": "decode", "prompts": [prompt16]}, NEW_TOKENS - 1),
        "decode tok/s (batch 8, aggregate)": ({"task": "decode", "prompts": batch8}, 8 * (NEW_TOKENS - 1)),
        PREFILL: ({"task": "prefill", "ids": prompt512}, 512),
        SCORING.format(len(scoring)): ({"task": "score", "batch": scoring}, len(scoring) * 256),
    }

    results: dict[str, dict] = {name: {} for name in engines}
    if config is None or stored_only:  # start-up runs, then every engine's worker at once, interleaved
        print(f"start-up runs ({len(engines)} engines)...", flush=True)
        for name, (engine, key) in engines.items():
            with tempfile.TemporaryDirectory() as cache:  # llama-jax's caches (executables, compilations) start empty
                env = envs[name] | {"LLAMA_JAX_CACHE": cache}
                seconds, rss = start_up(engine, paths[key], env)
                results[name]["start to first token, s (cold)"] = summary([seconds])
                if name.startswith(("llama-jax", "baseline")):  # again, with the caches the first run filled
                    warm = [start_up(engine, paths[key], env) for _ in range(3)]
                    results[name]["start to first token, s (warm caches)"] = summary([w[0] for w in warm])
                    results[name]["peak RSS, MB (first token, warm)"] = summary([w[1] for w in warm])
            results[name]["peak RSS, MB (first token)"] = summary([rss])
        jax_alone = statistics.median([start_up("jax", None, {})[1] for _ in range(3)])
        kv = kv_cache_bytes(config or HERE.parent / "configs" / "smollm2-135m.json")
        for name, (engine, _) in engines.items():  # what a first token's RSS is read against: JAX + what it holds
            if name.startswith(("llama-jax", "baseline")):
                held = weight_bytes(paths["stored"], llama_jax_width(engine)) + kv
                results[name][START_ROWS[-1]] = summary([jax_alone + held / 1e6 + 50])
        groups = [list(engines)]
    else:  # a large model: no start-up runs; one engine's worker at a time, the fidelity reference first
        groups = [[name] for name in sorted(engines, key=lambda n: n != REFERENCE)]

    expected = None  # the fidelity reference: transformers F32's logits after the 512-token prompt
    for group in groups:
        workers = {}
        for name in group:
            print(f"loading {name}...", flush=True)
            engine, key = engines[name]
            workers[name] = Worker(engine, paths[key], envs[name])
        runs = trials(workers, tasks, args.trials)
        if REFERENCE in workers:
            expected = logits(workers[REFERENCE], prompt512)
        for name, worker in workers.items():
            results[name] |= finish(worker, runs[name], prompt512, expected)

    for name, (engine, key) in engines.items():  # the weights a batch-1 step reads, at its rate
        width = llama_jax_width(engine) if engine.startswith("llama-jax") else None
        size = weight_bytes(paths["stored" if key == "llama-jax" else key], width)
        read = [rate * size / 1e9 for rate in results[name][BATCH1]["runs"]]
        results[name][READ] = summary(read)
        if BANDWIDTH in results[name]:
            bandwidth = results[name][BANDWIDTH]["runs"]
            results[name][SHARE] = summary([100 * r / b for r, b in zip(read, bandwidth, strict=True)])
        for task, (row, length, every_logit) in PEAK_SHARE.items():
            task = task.format(len(scoring))
            if "f32_fma_gflops" in machine and task in results[name]:
                flops = flops_per_token(config or HERE.parent / "configs" / "smollm2-135m.json", length, every_logit)
                shares = [
                    100 * rate * flops / (machine["f32_fma_gflops"] * 1e9) for rate in results[name][task]["runs"]
                ]
                results[name][row] = summary(shares)
    shares = [row for row, _, _ in PEAK_SHARE.values()]
    rows = [*tasks, *shares, READ, BANDWIDTH, SHARE, *(START_ROWS if config is None or stored_only else [])]
    rows.append("peak RSS, MB (whole run)")
    rows.append(FIDELITY)
    width = max(len(r) for r in rows)
    print()
    print_row("", list(engines), width)
    for row in rows:
        cells = []
        for name in engines:
            s = results[name].get(row)
            digits = ".2g" if row == FIDELITY else ".1f"
            cells.append(
                "n/a"
                if s is None
                else f"{s['median']:{digits}}" + (f" ({s['min']:.1f}-{s['max']:.1f})" if len(s["runs"]) > 1 else "")
            )
        print_row(row, cells, width)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": model,
        "machine": cpu_name(),
        "cores": os.cpu_count(),
        "threads": THREADS,
        "trials": args.trials,
        "python": sys.version.split()[0],
        "llama.cpp build": llama_cpp_build(),
        "peaks": machine,
    }
    out = {"meta": meta, "results": results}
    if config is not None:
        out["ratios"] = ratios(results, list(tasks), args.file_type)
        print(f"\n{stored}'s median tok/s over each peer's:")
        print_row("", [f"vs {p}" for p in (*PEERS, f"llama.cpp {args.file_type}")], width)
        for task, row in out["ratios"].items():
            print_row(task, ["n/a" if r is None else f"{r:.2f}" for r in row.values()], width)
    print(f"llama.cpp build: {meta['llama.cpp build']}")
    Path(json_path).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {json_path}")


if __name__ == "__main__":
    main()
