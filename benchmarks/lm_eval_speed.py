"""lm-eval's loglikelihood requests per second, llama-jax beside lm-eval's own `hf` backend, in one process and
one run: 64 capital-city questions (examples/tasks/capitals.jsonl under 8 phrasings) × 4 choices = 256 unique
requests, batch 8, 2 threads, each backend warmed up first (a whole pass: llama-jax compiles a scoring shape per
length), two rounds each, alternating.

    taskset -c 0,1 .venv/bin/python benchmarks/lm_eval_speed.py

Both read the default model converted to a Hugging Face directory (made once under $TMPDIR).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")

import torch
from lm_eval.api.instance import Instance
from lm_eval.api.registry import get_model

import llama_jax
import llama_jax.lm_eval  # registers "llama-jax"

TEMPLATES = [
    "Question: What is the capital of {}?\nAnswer:",
    "Q: Which city is the capital of {}?\nA:",
    "The capital city of {} is called",
    "{}'s seat of government is in the city of",
    "Quiz. Name the capital of {}.\nAnswer:",
    "In geography class we learned that the capital of {} is",
    "Capital of {}:",
    "Travel guide: the capital of {} is",
]


def main() -> None:
    torch.set_num_threads(2)
    converted = Path(tempfile.gettempdir()) / "llama-jax-smollm2-f32"
    if not (converted / "config.json").exists():
        llama_jax.convert_gguf(llama_jax.default_model_path(), converted, overwrite=True)
    rows = [json.loads(line) for line in (Path(__file__).parent.parent / "examples/tasks/capitals.jsonl").open()]
    requests = [
        Instance("loglikelihood", {}, (t.format(r["country"]), " " + c), 0)
        for t in TEMPLATES
        for r in rows
        for c in r["choices"]
    ]
    backends = {
        "llama-jax": get_model("llama-jax").create_from_arg_string(f"path={converted},batch_size=8"),
        "hf": get_model("hf").create_from_arg_string(f"pretrained={converted},dtype=float32,batch_size=8,device=cpu"),
    }
    for lm in backends.values():
        lm.loglikelihood(requests, disable_tqdm=True)  # warm: every shape compiled, allocations made
    for _ in range(2):
        for name, lm in backends.items():
            time.sleep(1)  # the other backend's threads idle first (OpenMP's and XLA's spin a while after work)
            start = time.perf_counter()
            lm.loglikelihood(requests, disable_tqdm=True)
            seconds = time.perf_counter() - start
            print(f"{name}: {len(requests)} requests in {seconds:.2f} s = {len(requests) / seconds:.1f} requests/s")


if __name__ == "__main__":
    main()
