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
from llama_jax.nn.linear import product, runs_native, tier_input
from llama_jax.nn.norm import rms_norm


def embed(weights: Weights, tokens: Int[ArrayLike, "B T"], config: LlamaConfig) -> Float[Array, "B T D"]:
    """The first layer's input: the embedding rows of the tokens in the compute dtype (f32; f64 for f64 weights),
    times the config's embedding_multiplier where it has one (Granite's)."""
    rows = take_rows(weights.emb, tokens)  # [B, T, D]
    x = rows.astype(jnp.promote_types(rows.dtype, jnp.float32))  # [B, T, D]
    return x if config.embedding_multiplier == 1.0 else x * jnp.asarray(config.embedding_multiplier, x.dtype)


def unembed(
    weights: Weights, x: Float[Array, "B T D"], config: LlamaConfig, native: bool = False, step: bool = False
) -> tuple[Array, Array]:
    """The final norm and the logits (the LM head, tied to the embedding unless the checkpoint has its own) of a
    residual stream x: the model's own output for the last layer's, a logit lens for another layer's. native
    and step (static): as `linear.product` has them (step: one position per sequence, the head of prefill and
    decode). The logits are divided by the config's logits_scaling where it has one (Granite's)."""
    nf = rms_norm(x, weights.lnf, config.eps)  # [B, T, D]
    head, bf16_x = weights.unembedding(), config.precision != "float32"
    rounded = tier_input(nf, config.precision)  # [B, T, D]
    logits = product(rounded, head, native, blocked=False, step=step, bf16_x=bf16_x)  # [B, T, V]
    return nf, scaled_logits(logits, config)


def scaled_logits(logits: Float[Array, "*A V"], config: LlamaConfig) -> Float[Array, "*A V"]:
    """The head's products divided by the config's logits_scaling (Granite's; 1: unchanged, no division)."""
    return logits if config.logits_scaling == 1.0 else logits / jnp.asarray(config.logits_scaling, logits.dtype)


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
    nf = tier_input(rms_norm(x, weights.lnf, config.eps), config.precision)  # [*A, D]: what the head multiplies
    head = weights.unembedding()  # [V, D]
    keep = jnp.zeros(0, jnp.int32) if keep is None else keep  # [R]
    if runs_native(head, nf.dtype, native):
        divisor = config.logits_scaling
        chosen, best, top, log_total, logits = kernels.score_head(head, nf, targets, keep, divisor)  # [R, V] last
        kept = (logits - top.reshape(-1, 1)[keep]) - log_total.reshape(-1, 1)[keep]  # [R, V]
        return chosen, best, kept
    logits = scaled_logits(product(nf, head, False, blocked=False), config)  # [*A, V]
    rows = log_softmax_last(logits)  # [*A, V]: each row alone (see `invariant`)
    chosen = jnp.take_along_axis(rows, jnp.maximum(targets, 0)[..., None], axis=-1)[..., 0]  # [*A]
    best = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [*A]
    return chosen, best, rows.reshape(-1, rows.shape[-1])[keep]  # [*A] each, [R, V]
