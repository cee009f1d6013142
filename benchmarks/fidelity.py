"""A --model of run.py (a random-weight GGUF, weights.py) checked as a user would: llama-jax loads its Q4_1 file,
or with --file-type Q4_K_M llama.cpp's Q4_K_M of it (the stored blocks), and against transformers F32 on the
converted (dequantized) directory (eager attention): the logits of a prompt (max |Δlogit|, and both engines'
distance from transformers float64, where its weights take under half the memory), greedy tokens against
`generate`, and the scored log-probabilities. Without transformers' timed runs, which take minutes a task at 1B on
2 cores. Only the files it reads are made (the stored file, transformers' directory).

    .venv/bin/python benchmarks/fidelity.py --model llama-3.2-1b [--file-type Q4_K_M] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import FILE_TYPES, MODELS, f32_bytes
from weights import prepare

TEXT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b", help=f"{', '.join(m for m in MODELS if MODELS[m])}")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--file-type", default="Q4_1", choices=FILE_TYPES)
    args = parser.parse_args()
    import torch
    from transformers import AutoModelForCausalLM

    import llama_jax

    config = MODELS[args.model] if args.model in MODELS else Path(args.model)
    paths = prepare(config, args.file_type, {"hf-f32"})
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    f64 = 2 * f32_bytes(config) < memory / 2  # transformers float64 beside its float32 copy and llama-jax's
    start = time.perf_counter()
    model = llama_jax.load(paths["stored"], dtype="stored")
    seconds = time.perf_counter() - start
    print(f"llama-jax loaded {paths['stored'].name} in {seconds:.1f} s; RoPE: {model.config.rope.describe()}")
    print(f"held: {model.weights.describe()}")
    ids = model.tokenizer.encode(TEXT)
    hf = AutoModelForCausalLM.from_pretrained(paths["hf-f32"], dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        x = torch.tensor([ids])
        f32 = hf.eval()(x).logits[0].numpy()
        f64 = hf.double()(x).logits[0].numpy() if f64 else None
        hf.float()
        expected = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.new_tokens, do_sample=False,
                               eos_token_id=None)[0, len(ids):].tolist()  # fmt: skip
    mine = np.asarray(model.logits(ids))
    print(f"{len(ids)} tokens: {ids[:6]}...")
    print(f"max |Δlogit| llama-jax vs transformers F32: {np.abs(mine - f32).max():.2g}")
    if f64 is None:
        print(f"transformers float64 not run: {2 * f32_bytes(config) / 1e9:.0f} GB of weights, over half the memory")
    else:
        print(f"from transformers float64: llama-jax {np.abs(mine - f64).max():.2g}, F32 {np.abs(f32 - f64).max():.2g}")
    new = model.generate_ids(ids, args.new_tokens)
    print(f"{args.new_tokens} greedy tokens equal to transformers' generate: {new == expected}")
    reference = ("float64", f64) if f64 is not None else ("float32", f32)
    logp = torch.log_softmax(torch.tensor(reference[1]), -1).numpy()[np.arange(len(ids) - 1), ids[1:]]
    scored = np.asarray(model.score([TEXT])[0].logprobs)
    print(f"scored log-probabilities, max |Δ| from transformers {reference[0]}'s: {np.abs(scored - logp).max():.2g}")


if __name__ == "__main__":
    main()
