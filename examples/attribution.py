"""Attribution over the layers: gradient × activation of each layer's output y (the residual stream), for the
log-probability of the next token, at every position of a prompt.

    .venv/bin/python examples/attribution.py ["prompt"] [" target"]

Each cell is Σ_width grad·y of one layer (row) at one position (column): a first-order estimate of how much that
position's residual stream at that layer contributes to the log-probability of the target token. The last row is
about 0: the final RMSNorm is scale-invariant, so the gradient at its input is orthogonal to it.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

import llama_jax
from llama_jax import research


def main(prompt: str = "The capital of France is", target: str = " Paris") -> None:
    model = llama_jax.load()
    ids = model.tokenizer.encode(prompt)
    target_id = model.tokenizer.encode(target)[0]

    def log_prob(logits):  # logits: [T, vocab], a JAX array
        return jax.nn.log_softmax(logits[-1])[target_id]

    acts, grads = research.activation_grads(model, ids, log_prob)
    attribution = (grads["y"] * acts["y"]).sum(-1)  # [layers, T]
    p = float(np.exp(log_prob(acts["logits"])))
    tokens = [model.tokenizer.decode([i]) for i in ids]

    print(f"prompt {prompt!r}, target {target!r} (id {target_id}), p = {p:.3f}")
    print("gradient x activation of y, summed over the width (rows: layers; columns: positions)")
    print("layer " + "".join(f"{t!r:>12}" for t in tokens))
    for layer in range(attribution.shape[0]):
        print(f"{layer:>5} " + "".join(f"{v:>12.3f}" for v in attribution[layer]))
    top = np.unravel_index(np.abs(attribution).argmax(), attribution.shape)
    print(f"largest |attribution|: layer {top[0]}, position {top[1]} ({tokens[top[1]]!r})")


if __name__ == "__main__":
    main(*sys.argv[1:3])
