"""The ends of the model: the embedding of the input tokens, and the final norm with the LM head (tied to the
embedding unless the checkpoint has its own) that turns a residual stream into logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int

from llama_jax import kernels
from llama_jax.core.config import LlamaConfig
from llama_jax.core.quantized import dense, take_rows
from llama_jax.core.weights import Weights
from llama_jax.nn.linear import linear
from llama_jax.nn.norm import rms_norm


def embed(weights: Weights, tokens: Int[ArrayLike, "B T"]) -> Float[Array, "B T D"]:
    """The embedding rows of the tokens, in the compute dtype (f32; f64 for f64 weights)."""
    rows = take_rows(weights.emb, tokens)  # [B, T, D]
    return rows.astype(jnp.promote_types(rows.dtype, jnp.float32))  # [B, T, D]


def unembed(
    weights: Weights, x: Float[Array, "B T D"], config: LlamaConfig, native: bool = False
) -> tuple[Array, Array]:
    """The final norm and the logits (the LM head, tied to the embedding unless the checkpoint has its own) of a
    residual stream x: the model's own output for the last layer's, a logit lens for another layer's."""
    nf = rms_norm(x, weights.lnf, config.eps)  # [B, T, D]
    if native:  # one position per sequence: the native kernel over the [1, V, D] view of the head
        head = jax.tree.map(lambda a: a[None], weights.head())  # [1, V, D]
        return nf, kernels.matvec(head, jnp.int32(0), nf[:, 0])[:, None]  # [B, 1, V]
    return nf, linear(nf, dense(weights.head()), blocked=False)  # [B, T, V]
