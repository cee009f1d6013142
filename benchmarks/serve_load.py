"""A load test of `llama-jax serve` beside llama.cpp's server (llama-cpp-python's `llama_cpp.server`, the same
GGUF file) where it is installed: N concurrent clients × M streamed completions each, on loopback only.

    taskset -c 0,1 .venv/bin/python benchmarks/serve_load.py [--clients 8] [--requests 4] [--max-tokens 64]
        [--hostile] [--shared-prefix WORDS]

Each server runs alone (one after the other) with 2 threads (llama.cpp's with --interrupt_requests False, as a user
under load sets it: by default a new request interrupts the one streaming); every client sends its requests one
after another (greedy, max_tokens new tokens, prompts of 5-40 tokens) and reads the stream. Rows per server:
aggregate new tokens/s (all tokens over the wall time of the whole run), time to first token and time between
tokens (p50, p90, p99), errors. Bounded: a run stops after --timeout seconds.

--hostile: each server runs a second time with one more client, a hostile one, sending in turn until the others are
done: a 16 MB body (a prompt of ordinary words), a 64 MB body in chunks, JSON nested 100,000 deep, a prompt past the
context. The rows of both runs are printed side by side: the well-behaved clients' tokens/s and gaps, and what the
hostile client got (statuses, or the errors its connection met).

--shared-prefix: every prompt begins with the same text of that many words (a system prompt), and llama-jax serve
runs a second time without its prompt cache (--prompt-cache-mb 0): the rows before and after.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The three primary colors are",
    "Explain in one paragraph why the sky is blue during the day and red at sunset:",
    "A list of five fruits: 1.",
    "Water boils at 100 degrees Celsius at sea level because",
    "The history of the Roman Empire spans many centuries, beginning with",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], url: str, log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{command[0]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.3)
    process.kill()
    raise RuntimeError(f"{command} did not start")


def one_request(url: str, model: str, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    """A streamed greedy completion: the time to its first token, the times between tokens, the tokens."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start, times = time.perf_counter(), []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("finish_reason") is None:
                times.append(time.perf_counter())
    if not times:
        raise RuntimeError("no tokens")
    return times[0] - start, list(np.diff(times)), len(times)


def hostile_bodies(model: str) -> list[tuple[str, bytes]]:
    words = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. "
    text = (words * (64_000_000 // len(words) + 1))[:64_000_000]
    return [
        ("16 MB", json.dumps({"model": model, "prompt": text[:16_000_000], "max_tokens": 4}).encode()),
        ("64 MB chunked", json.dumps({"model": model, "prompt": text, "max_tokens": 4}).encode()),
        ("nested", b"[" * 100_000 + b"]" * 100_000),
        ("past the context", json.dumps({"model": model, "prompt": words * 300, "max_tokens": 4}).encode()),
    ]


def hostile_client(url: str, bodies: list[tuple[str, bytes]], stop: threading.Event, got: dict) -> None:
    """Sends the bodies in turn, 0.1 s apart, until stop; got: (body, status or error type) → how many times."""
    while not stop.is_set():
        for name, body in bodies:
            content = (body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)) if "chunked" in name else body
            try:
                outcome = str(httpx.post(f"{url}/v1/completions", content=content, timeout=120).status_code)
            except httpx.HTTPError as e:
                outcome = type(e).__name__
            got[f"{name}: {outcome}"] = got.get(f"{name}: {outcome}", 0) + 1
            if stop.wait(0.1):  # (a client, not a flood: the machine's cores are the servers' too)
                return


def load(url: str, model: str, clients: int, requests: int, max_tokens: int, timeout: float,
         hostile: list[tuple[str, bytes]] | None = None, prefix: str = "") -> dict:  # fmt: skip
    first, between, tokens, errors = [], [], [0], [0]
    lock = threading.Lock()
    deadline = time.monotonic() + timeout

    def client(c: int):
        for r in range(requests):
            if time.monotonic() > deadline:
                return
            try:
                ttft, gaps, n = one_request(url, model, prefix + PROMPTS[(c + r) % len(PROMPTS)], max_tokens)
            except (httpx.HTTPError, RuntimeError):
                with lock:
                    errors[0] += 1
                continue
            with lock:
                first.append(ttft)
                between.extend(gaps)
                tokens[0] += n

    one_request(url, model, PROMPTS[0], 8)  # warm: compiles, loads
    stop, got = threading.Event(), {}
    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    rogue = threading.Thread(target=hostile_client, args=(url, hostile, stop, got)) if hostile else None
    if rogue:
        rogue.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    stop.set()
    if rogue:
        rogue.join()

    def pct(values, p):
        return float(np.percentile(values, p)) * 1e3 if values else float("nan")

    return {
        "tokens_per_s": tokens[0] / wall, "tokens": tokens[0], "wall_s": wall, "errors": errors[0],
        "ttft_ms": [pct(first, p) for p in (50, 90, 99)], "itl_ms": [pct(between, p) for p in (50, 90, 99)],
        "hostile": got,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="per client")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--hostile", action="store_true", help="each server again with one hostile client added")
    parser.add_argument(
        "--shared-prefix",
        type=int,
        default=0,
        metavar="WORDS",
        help="every prompt after one shared text of WORDS words; llama-jax also without its cache",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from run import cpu_name

    import llama_jax

    gguf = llama_jax.default_model_path()
    servers = {
        "llama-jax serve": [
            sys.executable,
            "-m",
            "llama_jax.cli",
            "serve",
            "--model",
            str(gguf),
            "--model-name",
            "m",
            "--max-batch",
            str(args.clients),
        ],
    }
    if args.shared_prefix:
        servers["llama-jax serve, no prompt cache"] = [*servers["llama-jax serve"], "--prompt-cache-mb", "0"]
    sentence = "You are a careful assistant who answers briefly and cites the facts it uses. "
    words = sentence.split(" ")[:-1]
    prefix = " ".join(words[i % len(words)] for i in range(args.shared_prefix)) + "\n\n" * bool(args.shared_prefix)
    try:
        import llama_cpp.server.app  # noqa: F401 (its extra: fastapi, sse-starlette, ...)

        # --interrupt_requests False: by default a new request cuts the one streaming (concurrent clients get errors)
        servers["llama.cpp server"] = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf),
                                       "--model_alias", "m", "--n_threads", "2", "--n_ctx", "2048",
                                       "--interrupt_requests", "False"]  # fmt: skip
    except ImportError:
        print("llama-cpp-python's server is not installed (pip install 'llama-cpp-python[server]'): llama-jax alone")
    print(f"CPU: {cpu_name()}; {args.clients} clients x {args.requests} requests, {args.max_tokens} new tokens each")
    runs = {"": None} | ({" + 1 hostile client": hostile_bodies("m")} if args.hostile else {})
    results = {}
    for server, command in servers.items():
        for run_name, bodies in runs.items():
            name = server + run_name
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            flag = ["--port", str(port)] + (["--host", "127.0.0.1"] if "llama_cpp" in command[2] else [])
            process = start(command + flag, url, Path(f"/tmp/serve_load_{port}.log"))
            try:
                results[name] = load(
                    url, "m", args.clients, args.requests, args.max_tokens, args.timeout, bodies, prefix
                )
            finally:
                process.terminate()
                process.wait(timeout=120)
            r = results[name]
            print(f"{name}: {r['tokens_per_s']:.1f} tok/s ({r['tokens']} tokens in {r['wall_s']:.1f} s), errors"
                  f" {r['errors']}; first token p50/p90/p99 {'/'.join(f'{v:.0f}' for v in r['ttft_ms'])} ms; between"
                  f" tokens {'/'.join(f'{v:.0f}' for v in r['itl_ms'])} ms"
                  + (f"; the hostile client got {r['hostile']}" if bodies else ""))  # fmt: skip
    if "llama.cpp server" in results:
        ratio = results["llama-jax serve"]["tokens_per_s"] / results["llama.cpp server"]["tokens_per_s"]
        print(f"aggregate tokens/s, llama-jax / llama.cpp: {ratio:.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
