"""The logit lens as a picture: each layer's residual stream read out through the final norm and the LM head as
if it were the last layer, and the rank there of the token that actually comes next (0: the top choice), for
every layer (rows) and position (columns). Early layers rank the right token far down; the last row is the
model's own prediction.

    .venv/bin/python examples/logit_lens.py ["text"] [--out logit_lens.png] [--json]

The numbers are `llama_jax.research.logit_lens`; --json prints them. Needs matplotlib: pip install
'llama-jax[plot]'.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import numpy as np
from plotting import pyplot

import llama_jax
from llama_jax import research


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text", nargs="?", default="The capital of France is Paris, and the capital of Italy is Rome.")
    parser.add_argument("--out", default="logit_lens.png")
    parser.add_argument("--json", action="store_true", help="print the tokens, ranks and log-probabilities as JSON")
    args = parser.parse_args(argv)
    plt = pyplot()

    model = llama_jax.load()
    ids = model.tokenizer.encode(args.text)
    ranks, logps = research.logit_lens(model, ids)  # [layers, T-1] each
    tokens = [model.tokenizer.decode([i]) for i in ids]

    fig, ax = plt.subplots(figsize=(2.0 + 0.5 * ranks.shape[1], 1.5 + 0.22 * ranks.shape[0]))
    image = ax.imshow(np.log10(ranks + 1.0), cmap="magma_r", aspect="auto", vmin=0.0)
    columns = [f"{repr(a)[1:-1]}→{repr(b)[1:-1]}" for a, b in itertools.pairwise(tokens)]
    ax.set_xticks(range(len(columns)), columns, rotation=90)
    ax.set_ylabel("layer")
    ax.set_title("logit lens: rank of the next token at each layer")
    fig.colorbar(image, ax=ax, label="log10(rank + 1)")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    layers, positions = ranks.shape
    top = (ranks == 0).any(axis=1)  # [layers]: some next token is the top choice there
    first = f"a next token first ranks top at layer {int(top.argmax())}" if top.any() else "no next token ranks top"
    print(f"wrote {args.out}: {layers} layers x {positions} positions; {first}")
    if args.json:
        print(json.dumps({"tokens": tokens, "ranks": ranks.tolist(), "logprobs": logps.tolist()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
