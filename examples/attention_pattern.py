"""One attention head's pattern as a picture: where each position of a prompt looks (softmax probabilities,
query positions down, key positions across, causal: nothing above the diagonal).

    .venv/bin/python examples/attention_pattern.py ["prompt"] [--layer L] [--head N] [--out attention.png] [--json]

The numbers are the pattern site (`blocks.{L}.attn.hook_pattern` in TransformerLens' names), stored alone
(`keep=("pattern",)`). --json prints them as well. Needs matplotlib: pip install 'llama-jax[plot]'.
"""

from __future__ import annotations

import argparse
import json
import sys

from plotting import pyplot

import llama_jax
from llama_jax.lens import run_with_cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt", nargs="?", default="The cat sat on the mat because the cat was tired.")
    parser.add_argument("--layer", type=int, default=5)
    parser.add_argument("--head", type=int, default=2)
    parser.add_argument("--out", default="attention.png")
    parser.add_argument("--json", action="store_true", help="print the tokens and the pattern as JSON")
    args = parser.parse_args(argv)
    plt = pyplot()

    model = llama_jax.load()
    if not (0 <= args.layer < model.config.layers and 0 <= args.head < model.config.heads):
        parser.error(f"--layer must lie in 0..{model.config.layers - 1} and --head in 0..{model.config.heads - 1}")
    ids = model.tokenizer.encode(args.prompt)
    hook = f"blocks.{args.layer}.attn.hook_pattern"
    _, cache = run_with_cache(model, ids, names_filter=hook)
    pattern = cache[hook][0, args.head]  # [query, key]
    tokens = [model.tokenizer.decode([i]) for i in ids]

    fig, ax = plt.subplots(figsize=(1.0 + 0.45 * len(ids), 0.8 + 0.4 * len(ids)))
    image = ax.imshow(pattern, cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set_xticks(range(len(ids)), [repr(t)[1:-1] for t in tokens], rotation=90)
    ax.set_yticks(range(len(ids)), [repr(t)[1:-1] for t in tokens])
    ax.set_xlabel("key position (attended to)")
    ax.set_ylabel("query position")
    ax.set_title(f"layer {args.layer}, head {args.head}")
    fig.colorbar(image, ax=ax, label="attention probability")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}: layer {args.layer}, head {args.head}, {len(ids)} tokens")
    if args.json:
        print(json.dumps({"tokens": tokens, "pattern": pattern.tolist()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
