"""Attribution patching beside activation patching, as a picture: for a clean prompt and a corrupt one (another
country), the effect on the logit difference (the clean capital's logit minus the corrupt one's, at the last
position) of patching one layer's residual stream y (rows) at one position (columns) from the clean run into the
corrupt run: exactly (one patched forward pass a cell) and as AtP estimates it (one forward and one backward pass
for all of them).

    .venv/bin/python examples/attribution_patching.py [--clean " France" " Paris"] [--corrupt " Italy" " Rome"]
        [--site y] [--out attribution_patching.png] [--json]

The numbers are `llama_jax.research.activation_patching` and `attribution_patching`; --json prints them. Needs
matplotlib: pip install 'llama-jax[plot]'.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
from plotting import pyplot

import llama_jax
from llama_jax import research

TEMPLATE = "The capital city of{} is the city of"


def logit_difference(logits, target):  # the last position's logit of the clean answer minus the corrupt one's
    return logits[-1, target[0]] - logits[-1, target[1]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clean", nargs=2, default=[" France", " Paris"], metavar=("COUNTRY", "CAPITAL"))
    parser.add_argument("--corrupt", nargs=2, default=[" Italy", " Rome"], metavar=("COUNTRY", "CAPITAL"))
    parser.add_argument("--site", default="y", help="an Act site (default y, the residual stream)")
    parser.add_argument("--out", default="attribution_patching.png")
    parser.add_argument("--json", action="store_true", help="print the tokens and both grids as JSON")
    args = parser.parse_args(argv)
    plt = pyplot()

    model = llama_jax.load()
    clean, corrupt = TEMPLATE.format(args.clean[0]), TEMPLATE.format(args.corrupt[0])
    target = [model.tokenizer.encode(args.clean[1])[0], model.tokenizer.encode(args.corrupt[1])[0]]
    run = {"metric": logit_difference, "targets": [target], "sites": (args.site,)}
    exact = research.activation_patching(model, [clean], [corrupt], batch_size=16, **run)
    estimate = research.attribution_patching(model, [clean], [corrupt], **run)
    grids = {"exact": exact[args.site][0], "AtP estimate": estimate[args.site][0]}  # [layers, T] each
    tokens = [model.tokenizer.decode([i]) for i in model.tokenizer.encode(corrupt)]

    bound = max(np.abs(g).max() for g in grids.values())
    fig, axes = plt.subplots(1, 2, figsize=(2.0 + 0.9 * len(tokens), 7.0), sharey=True)
    for ax, (name, grid) in zip(axes, grids.items(), strict=True):
        image = ax.imshow(grid, cmap="RdBu", aspect="auto", vmin=-bound, vmax=bound)
        ax.set_xticks(range(len(tokens)), [repr(t)[1:-1] for t in tokens], rotation=90)
        ax.set_title(name)
    axes[0].set_ylabel("layer")
    fig.suptitle(f"patching {args.site} from{args.clean[0]!s} into{args.corrupt[0]!s}: effect on the logit difference")
    fig.colorbar(image, ax=axes, label=f"logit({args.clean[1]}) - logit({args.corrupt[1]})")
    fig.savefig(args.out, dpi=100)
    r = np.corrcoef(grids["exact"].ravel(), grids["AtP estimate"].ravel())[0, 1]
    print(
        f"wrote {args.out}: clean {exact['clean'][0]:.2f}, corrupt {exact['corrupt'][0]:.2f};"
        f" Pearson r of the estimates with the exact effects {r:.3f}"
    )
    if args.json:
        numbers = {"tokens": tokens, "exact": grids["exact"].tolist(), "estimate": grids["AtP estimate"].tolist()}
        print(json.dumps(numbers | {"clean": exact["clean"][0], "corrupt": exact["corrupt"][0]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
