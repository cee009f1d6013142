"""From text to a trained dictionary on one page: store the default model's residual stream at one layer over a
data set (`research.collect`), then train a sparse autoencoder on the stored rows in plain JAX.

    .venv/bin/python examples/sae.py [--layer 6] [--texts 400] [--steps 3000] [--out sae.png] [--json]

The data set is English prose that every Python carries: the paragraphs of the language reference's help topics
(`pydoc_data.topics`), each cut to its first 128 tokens. The autoencoder is the standard one (Bricken et al.
2023): f = ReLU(W_enc (x - b_dec) + b_enc), x̂ = W_dec f + b_dec, the decoder's columns kept at unit norm, trained
with Adam on ‖x - x̂‖² + λ‖f‖₁ over shuffled batches of the store (`ActivationStore.batches`). It prints and
plots the fraction of variance unexplained (‖x - x̂‖² / ‖x - mean x‖², over 2048 of the stored rows) and L0 (the
features active a row) as it trains. Needs matplotlib: pip install 'llama-jax[plot]'.
"""

from __future__ import annotations

import argparse
import functools
import json
import pydoc_data.topics
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from plotting import pyplot

import llama_jax
from llama_jax import research

MAX_TOKENS = 128


def paragraphs(count: int) -> list[str]:
    """The first `count` paragraphs of 30 words or more of Python's help topics."""
    texts = [p.strip() for topic in pydoc_data.topics.topics.values() for p in topic.split("\n\n")]
    return [p for p in texts if len(p.split()) >= 30][:count]


def init(key, width: int, features: int) -> dict:
    k1, _ = jax.random.split(key)
    w_dec = jax.random.normal(k1, (features, width)) / np.sqrt(width)  # [F, D]
    w_dec = w_dec / jnp.linalg.norm(w_dec, axis=1, keepdims=True)
    return {"w_enc": w_dec.T, "b_enc": jnp.zeros(features), "w_dec": w_dec, "b_dec": jnp.zeros(width)}


def encode(params: dict, x):  # x [N, D] -> f [N, F]
    return jax.nn.relu((x - params["b_dec"]) @ params["w_enc"] + params["b_enc"])


def reconstruct(params: dict, x):  # x [N, D] -> (x̂ [N, D], f [N, F])
    f = encode(params, x)
    return f @ params["w_dec"] + params["b_dec"], f


def loss(params: dict, x, l1: float):
    x_hat, f = reconstruct(params, x)
    return ((x - x_hat) ** 2).sum(-1).mean() + l1 * jnp.abs(f).sum(-1).mean()


@functools.partial(jax.jit, static_argnames=("l1", "lr"))
def train_step(params: dict, moments: dict, step, x, l1: float, lr: float):
    """One Adam step (β 0.9, 0.999), then the decoder's rows back to unit norm."""
    value, grads = jax.value_and_grad(loss)(params, x, l1)
    m = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, moments["m"], grads)
    v = jax.tree.map(lambda v, g: 0.999 * v + 0.001 * g * g, moments["v"], grads)
    t = step + 1
    params = jax.tree.map(
        lambda p, m, v: p - lr * (m / (1 - 0.9**t)) / (jnp.sqrt(v / (1 - 0.999**t)) + 1e-8), params, m, v
    )
    params["w_dec"] = params["w_dec"] / jnp.linalg.norm(params["w_dec"], axis=1, keepdims=True)
    return params, {"m": m, "v": v}, value


@jax.jit
def evaluate(params: dict, x):
    """The fraction of variance unexplained and the mean L0 over the rows x."""
    x_hat, f = reconstruct(params, x)
    fvu = ((x - x_hat) ** 2).sum() / ((x - x.mean(0)) ** 2).sum()
    return fvu, (f > 0).sum(-1).mean()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", type=int, default=6, help="the layer whose output y (the residual stream)")
    parser.add_argument("--texts", type=int, default=400, help="paragraphs to collect (default 400)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--features", type=int, default=4, help="the dictionary's width, in multiples of dim")
    parser.add_argument("--l1", type=float, default=2.0, help="the sparsity penalty λ (rows at mean norm √dim)")
    parser.add_argument("--out", default="sae.png")
    parser.add_argument("--store", help="the activation store's directory (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print the curves as JSON")
    args = parser.parse_args(argv)
    plt = pyplot()

    model = llama_jax.load()
    site = f"y.{args.layer}"
    ids = [model.tokenizer.encode(t)[:MAX_TOKENS] for t in paragraphs(args.texts)]
    store = research.collect(model, ids, [site], args.store or tempfile.mkdtemp(), batch_size=8)
    rows = np.asarray(store.array(site))  # [N, D]
    probe = rows[np.random.default_rng(1).permutation(len(rows))[:2048]]  # the rows the curves are measured on
    scale = float(np.linalg.norm(rows, axis=1).mean())
    print(f"stored {store.rows} rows of {site} ({len(ids)} texts) in {store.directory}; mean ‖x‖ {scale:.1f}")

    # the rows scaled to mean norm sqrt(D), so one learning rate and λ fit any layer
    norm = np.sqrt(rows.shape[1]) / scale
    params = init(jax.random.key(0), rows.shape[1], args.features * rows.shape[1])
    moments = {"m": jax.tree.map(jnp.zeros_like, params), "v": jax.tree.map(jnp.zeros_like, params)}
    curve = []
    step, epoch = 0, 0
    while step < args.steps:
        for batch in store.batches(512, keys=[site], seed=epoch, drop_last=True):
            if step == args.steps:
                break
            params, moments, _ = train_step(params, moments, step, jnp.asarray(batch[site]) * norm, args.l1, 1e-3)
            step += 1
            if step % max(args.steps // 20, 1) == 0 or step == args.steps:
                fvu, l0 = (float(v) for v in evaluate(params, jnp.asarray(probe) * norm))
                curve.append((step, fvu, l0))
                print(f"step {step:>5}: fraction of variance unexplained {fvu:.3f}, L0 {l0:.1f}")
        epoch += 1

    steps, fvus, l0s = zip(*curve, strict=True)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    top.plot(steps, fvus)
    top.set_ylabel("variance unexplained")
    top.set_title(f"a sparse autoencoder on {site} of {len(ids)} texts ({store.rows} rows)")
    bottom.plot(steps, l0s)
    bottom.set_ylabel("L0 (active features a row)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}: final fraction of variance unexplained {fvus[-1]:.3f}, L0 {l0s[-1]:.1f}")
    if args.json:
        print(
            json.dumps({"rows": store.rows, "steps": steps, "fvu": fvus, "l0": l0s, "features": len(params["b_enc"])})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
