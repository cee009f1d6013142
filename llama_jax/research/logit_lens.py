"""The logit lens: every layer's residual stream read out through the final norm and the LM head, as if it were
the last layer (nostalgebraist's method), one layer's [T, V] logits at a time."""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from llama_jax.core.config import LlamaConfig
from llama_jax.core.weights import Weights
from llama_jax.model import Model
from llama_jax.nn.head import unembed
from llama_jax.passes.forward import forward
from llama_jax.research.gradients import one_sequence


@functools.partial(jax.jit, static_argnames=("config", "native"))
def logit_lens_of(
    weights: Weights, tokens: Int[ArrayLike, " T"], config: LlamaConfig, native: bool = False
) -> tuple[Int[Array, "L T-1"], Float[Array, "L T-1"]]:
    """The functional core of `logit_lens`: for each layer's residual stream y, through the final norm and the
    LM head, the rank of each position's next token (0: the argmax; ties ranked by the strictly larger logits)
    and its log-probability, [L, T-1] each. One layer's [T, V] logits at a time (lax.map). native (static): the
    native block products."""
    _, acts = forward(weights, tokens[None], config, keep=("y",), native=native)
    targets = tokens[1:]  # [T-1]

    def one_layer(y: Float[Array, "1 T D"]) -> tuple[Array, Array]:
        _, logits = unembed(weights, y, config, native)  # [1, T, V]
        logits = logits[0, :-1]  # [T-1, V]: position t predicts token t + 1
        chosen = jnp.take_along_axis(logits, targets[:, None], axis=-1)  # [T-1, 1]
        rank = jnp.sum(logits > chosen, axis=-1)  # [T-1]
        logp = jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, None], axis=-1)[:, 0]  # [T-1]
        return rank, logp

    return jax.lax.map(one_layer, acts.layers.y)  # [L, T-1] each


def logit_lens(model: Model, ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """The logit lens of one sequence: each layer's residual stream read out through the final norm and the LM
    head as if it were the last layer. Returns the rank of each next token (0: the model's top choice) and its
    log-probability, [layers, T-1] each; the last layer's are those of the model's own logits."""
    tokens = one_sequence(model, ids)[0]
    ranks, logps = logit_lens_of(model.weights, tokens, model.config, model.native.active)
    return np.asarray(ranks), np.asarray(logps)
