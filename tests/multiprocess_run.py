"""Scoring and generation across processes: every process runs this same program; together they form one mesh over
all their devices, score a data set data-parallel and generate from a batch of prompts (greedy, then seeded).
Process 0 prints the log-probabilities and the new ids as JSON (or writes them to --out).

    # one machine, 2 processes of 2 host CPU devices each (a data axis of 4):
    python tests/multiprocess_run.py --coordinator 127.0.0.1:4321 --processes 2 --process-id 0 --cpu-devices 2 &
    python tests/multiprocess_run.py --coordinator 127.0.0.1:4321 --processes 2 --process-id 1 --cpu-devices 2

Across hosts it is the same, with the address of process 0's host as the coordinator and each host's own
--process-id. Without --coordinator: one process, the model unsharded (the reference that
tests/test_multiprocess.py compares the others with).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import jax

# 11 texts of 2 to 79 bytes (the byte tokenizer: a token each): two batches of 8 rows, the longest 8 padded to the
# 128 bucket, the other 3 to 16 and with 5 rows of padding; each device holds 2 rows of each
TEXTS = [
    "Hi",
    "The capital of France is Paris.",
    "Water boils at 100 degrees Celsius at sea level.",
    "def add(a, b):\n    return a + b",
    "Once upon a time, in a small village by the sea, there lived an old fisherman.",
    "1 2 3 4 5",
    "Photosynthesis converts light into chemical energy.",
    "The quick brown fox jumps over the lazy dog.",
    "abc",
    "Rome was not built in a day.",
    "To be, or not to be, that is the question.",
]
BATCH = 8  # rows per batch: a multiple of the data axis (4 devices in the tests)
PROMPTS = TEXTS[:4] + TEXTS[5:9]  # 8 prompts of 3 to 79 bytes, a row each, 2 on each device
NEW_TOKENS = 20  # three chunks of the decode loop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--coordinator", help="HOST:PORT of process 0 (omit for one unsharded process)")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--cpu-devices", type=int, help="host CPU devices in this process (default: JAX's)")
    parser.add_argument("--out", help="where process 0 writes the JSON (default: stdout)")
    args = parser.parse_args()
    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # before anything touches a device
    if args.coordinator:  # before the model is built: jax.devices() then covers every process
        jax.distributed.initialize(args.coordinator, num_processes=args.processes, process_id=args.process_id)

    import llama_jax
    from llama_jax.testing import tiny_model

    model = tiny_model(seed=7)  # the same seed in every process: the same weights
    if args.coordinator:
        model = model.shard(llama_jax.make_mesh(data=len(jax.devices())))  # data-parallel over all processes
    scores = model.score(TEXTS, batch_size=BATCH)
    greedy = model.complete(PROMPTS, NEW_TOKENS)
    seeded = model.complete(PROMPTS, NEW_TOKENS, temperature=0.9, top_k=40, top_p=0.95, seed=11)
    if jax.process_index() == 0:
        out = {
            "processes": jax.process_count(),
            "devices": len(jax.devices()),
            "logprobs": [s.logprobs.tolist() for s in scores],
            "greedy": [s.greedy for s in scores],
            "greedy_ids": [c.ids for c in greedy],
            "seeded_ids": [c.ids for c in seeded],
        }
        if args.out:
            Path(args.out).write_text(json.dumps(out))
        else:
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # exit at once: jax.distributed's exit waits for the other processes, which wait for this
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
