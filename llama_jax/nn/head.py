"""The ends of the model: the embedding of the input tokens, and the final norm with the LM head (tied to the
embedding unless the checkpoint has its own) that turns a residual stream into logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from llama_jax import kernels
from llama_jax.core.config import LlamaConfig
from llama_jax.core.quantized import take_rows
from llama_jax.core.weights import Weights
from llama_jax.nn.linear import product
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
    (static): the native kernels, the matrix-vector one where `step` (static: one position per sequence, the head
    of prefill and decode), else the block product."""
    nf = rms_norm(x, weights.lnf, config.eps)  # [B, T, D]
    head = weights.head()  # [V, D]
    if native and step:  # the native kernel over the [1, V, D] view of the head
        stacked = jax.tree.map(lambda a: a[None], head)  # [1, V, D]
        return nf, kernels.matvec(stacked, jnp.int32(0), nf[:, 0])[:, None]  # [B, 1, V]
    return nf, product(nf, head, native, blocked=False)  # [B, T, V]
