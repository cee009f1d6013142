"""The ends of the model: the embedding of the input tokens, and the final norm with the LM head (tied to the
embedding unless the checkpoint has its own) that turns a residual stream into logits (`unembed`) or into the
log-probabilities of chosen tokens (`score_rows`)."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from llama_jax import kernels
from llama_jax.core.config import LlamaConfig
from llama_jax.core.quantized import take_rows
from llama_jax.core.weights import Weights
from llama_jax.nn.invariant import log_softmax_last
from llama_jax.nn.linear import product, runs_native
from llama_jax.nn.norm import rms_norm


def embed(weights: Weights, tokens: Int[ArrayLike, "B T"]) -> Float[Array, "B T D"]:
    """The embedding rows of the tokens, in the compute dtype (f32; f64 for f64 weights)."""
    rows = take_rows(weights.emb, tokens)  # [B, T, D]
    return rows.astype(jnp.promote_types(rows.dtype, jnp.float32))  # [B, T, D]


def unembed(
    weights: Weights, x: Float[Array, "B T D"], config: LlamaConfig, native: bool = False, step: bool = False
) -> tuple[Array, Array]:
    """The final norm and the logits (the LM head, tied to the embedding unless the checkpoint has its own) of a
    residual stream x: the model's own output for the last layer's, a logit lens for another layer's. native
    and step (static): as `linear.product` has them (step: one position per sequence, the head of prefill and
    decode)."""
    nf = rms_norm(x, weights.lnf, config.eps)  # [B, T, D]
    return nf, product(nf, weights.unembedding(), native, blocked=False, step=step)  # [B, T, V]


def score_rows(
    weights: Weights,
    x: Float[Array, "*A D"],
    targets: Int[Array, "*A"],
    config: LlamaConfig,
    native: bool = False,
    keep: Int[Array, " R"] | None = None,
) -> tuple[Float[Array, "*A"], Int[Array, "*A"], Float[Array, "R V"]]:
    """Of each row of a residual stream x (the last layer's output) whose target is not -1, after the final norm
    and the LM head: the target's log-probability and the argmax (a row of target -1: its values mean nothing);
    and the whole vocabulary's log-probabilities of the rows `keep` names (indices into x's rows flattened,
    ascending), in the same bits as the targets'. The one place that chooses the scoring head: with native
    (static) the native kernel where it multiplies the head (`kernels.score_head`: the scored rows only, blocked
    over the vocabulary, no [rows, V] array), else XLA's logits of every row (`unembed`'s) and their
    log-softmax."""
    nf = rms_norm(x, weights.lnf, config.eps)  # [*A, D]
    head = weights.unembedding()  # [V, D]
    keep = jnp.zeros(0, jnp.int32) if keep is None else keep  # [R]
    if runs_native(head, nf.dtype, native):
        chosen, best, top, log_total, logits = kernels.score_head(head, nf, targets, keep)  # [*A] each, [R, V]
        kept = (logits - top.reshape(-1, 1)[keep]) - log_total.reshape(-1, 1)[keep]  # [R, V]
        return chosen, best, kept
    logits = product(nf, head, False, blocked=False)  # [*A, V]
    rows = log_softmax_last(logits)  # [*A, V]: each row alone (see `invariant`)
    chosen = jnp.take_along_axis(rows, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]  # [*A]
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [*A]
    return chosen, best, rows.reshape(-1, rows.shape[-1])[keep]  # [*A] each, [R, V]
