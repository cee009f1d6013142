"""How well attribution patching (AtP) estimates activation patching on the default model, site by site.

    taskset -c 0,1 .venv/bin/python benchmarks/attribution_patching.py [--pairs 8]

Pairs: "The capital city of {country} is the city of" with the next country of a list as its corrupt twin; the
metric: the clean capital's logit minus the corrupt one's at the last position. For each site, over every
layer, position and pair: the Pearson correlation of the estimates with the exact effects, and the top-10
agreement of each pair (the share of the estimate's 10 largest |effects| that are among the exact 10 largest,
effects within 1% of the largest counted as ties: a column of equal exact effects has no single top 10; and
without ties). Also the time of each method.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

CAPITALS = [
    (" France", " Paris"), (" Italy", " Rome"), (" Spain", " Madrid"), (" Germany", " Berlin"),
    (" Japan", " Tokyo"), (" Russia", " Moscow"), (" Egypt", " Cairo"), (" England", " London"),
]  # fmt: skip
TEMPLATE = "The capital city of{} is the city of"
SITES = ("y", "mid", "a", "m", "attn", "pattern")
TOP = 10


def logit_difference(logits, target):
    return logits[-1, target[0]] - logits[-1, target[1]]


def top_agreement(estimate: np.ndarray, exact: np.ndarray, tie: float = 0.01) -> float:
    """The share of the estimate's TOP largest |values| that are among the exact TOP largest, counting as tied with
    the TOP-th exact value any within `tie` of the largest exact effect (a column of equal effects: layers before
    the information moves all carry the whole difference, to float rounding)."""
    magnitude = np.abs(exact.ravel())
    chosen = np.argsort(-np.abs(estimate.ravel()))[:TOP]
    bar = np.sort(magnitude)[-TOP] - tie * magnitude.max()
    return float((magnitude[chosen] >= bar).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=len(CAPITALS))
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from run import cpu_name

    import llama_jax
    from llama_jax import research

    model = llama_jax.load()
    swaps = [(CAPITALS[i], CAPITALS[(i + 1) % len(CAPITALS)]) for i in range(args.pairs)]
    clean = [TEMPLATE.format(a[0]) for a, _ in swaps]
    corrupt = [TEMPLATE.format(b[0]) for _, b in swaps]
    targets = [[model.tokenizer.encode(a[1])[0], model.tokenizer.encode(b[1])[0]] for a, b in swaps]
    run = {"metric": logit_difference, "targets": targets, "sites": SITES}
    research.attribution_patching(model, clean[:1], corrupt[:1], **run | {"targets": targets[:1]})  # compile
    start = time.perf_counter()
    estimates = research.attribution_patching(model, clean, corrupt, **run)
    atp = time.perf_counter() - start
    start = time.perf_counter()
    exact = research.activation_patching(model, clean, corrupt, batch_size=16, **run)
    patched = time.perf_counter() - start
    print(f"CPU: {cpu_name()}")
    print(f"{args.pairs} pairs, {len(SITES)} sites: AtP {atp:.1f} s, exact patching {patched:.1f} s")
    print(f"metric, clean runs {np.round(exact['clean'], 2)}, corrupt runs {np.round(exact['corrupt'], 2)}")
    print(f"| site | Pearson r | top-{TOP} agreement (ties within 1%) | strict top-{TOP} | largest exact effect |")
    print("|---|---|---|---|---|")
    for site in SITES:
        e = np.concatenate([x.ravel() for x in estimates[site]])
        x = np.concatenate([x.ravel() for x in exact[site]])
        pairs = list(zip(estimates[site], exact[site], strict=True))
        agree = np.mean([top_agreement(a, b) for a, b in pairs])
        strict = np.mean([top_agreement(a, b, tie=0.0) for a, b in pairs])
        print(f"| {site} | {np.corrcoef(e, x)[0, 1]:.3f} | {agree:.2f} | {strict:.2f} | {np.abs(x).max():.2f} |")


if __name__ == "__main__":
    main()
