"""One engine in its own process: reads JSON requests on stdin ({"task": ..., ...}), answers one JSON line each.
Started by run.py; `python benchmarks/worker.py ENGINE PATH` where ENGINE is one of run.ENGINES (PATH "" for
llama-jax: the default model)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engines import LlamaCpp, LlamaJax, Transformers, peak_rss_mb


def make(engine: str, path: str):
    kind, dtype = engine.split(":")
    if kind == "llama-jax":
        return LlamaJax(dtype, path or None)
    if kind == "transformers":
        return Transformers(path, dtype)
    return LlamaCpp(path)


def main() -> None:
    engine = make(sys.argv[1], sys.argv[2])
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        task = request["task"]
        if task == "decode":
            answer = {"seconds": engine.decode(request["prompts"])}
        elif task == "prefill":
            answer = {"seconds": engine.prefill(request["ids"])}
        elif task == "score":
            answer = {"seconds": engine.score(request["batch"])}
        elif task == "first_token":
            answer = {"token": int(engine.first_logits(request["ids"]).argmax())}
        elif task == "logits":
            answer = {"logits": engine.first_logits(request["ids"]).astype(float).tolist()}
        else:
            answer = {"peak_rss_mb": peak_rss_mb()}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
