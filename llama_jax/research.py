"""Research on the stored activations: read them, edit them, and take gradients through them.

Every activation of `Act` (the spec's n1 q k v qr kr attn a n2 m y and the research sites pattern, mid, hidden,
per layer) is a site of `forward`'s edits. `logit_lens` reads every layer's residual stream through the LM head.
The gradient of a loss with respect to an activation is the gradient with respect to an intervention of zeros
added at that site, which is how `activation_grads` computes them all in one backward pass. All of this is
jit- and vmap-able: the functions here are thin wrappers over the pure `forward` and `forward_embeds`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from llama_jax.config import LlamaConfig
from llama_jax.model import Model
from llama_jax.nn.block import ACT_NAMES, Act, act_shape
from llama_jax.passes import Activations, check_sequence, embed, forward, forward_embeds, unembed
from llama_jax.quantized import compute_dtype
from llama_jax.weights import Weights

LossFn = Callable[[Float[Array, "T V"]], Float[Array, ""]]


def zero_interventions(config: LlamaConfig, batch: int, length: int, dtype=jnp.float32) -> Act:
    """An intervention of zeros at every site: [L, *site's shape] each (adding it changes nothing)."""
    return Act(**{n: jnp.zeros((config.layers, *act_shape(n, config, batch, length)), dtype) for n in ACT_NAMES})


@functools.partial(jax.jit, static_argnames=("config", "loss_fn"))
def activation_grads_of(
    weights: Weights, tokens: Int[ArrayLike, " T"], config: LlamaConfig, loss_fn: LossFn
) -> tuple[Activations, Act]:
    """The functional core of `activation_grads`, for one sequence of ids: the activations ([L, 1, T, width] each;
    the pattern [L, 1, N, T, T]) and the gradients of loss_fn(logits [T, V]) with respect to them (same shapes).
    jax.vmap it over a batch of sequences; config and loss_fn are static."""

    def loss(add: Act):
        logits, acts = forward(weights, tokens[None], config, keep=True, add=add)
        return loss_fn(logits[0]), acts

    zeros = zero_interventions(config, 1, tokens.shape[0], compute_dtype(weights.emb))
    grads, acts = jax.grad(loss, has_aux=True)(zeros)
    return acts, grads


def activation_grads(
    model: Model, ids: Sequence[int], loss_fn: LossFn
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Every activation of one sequence and the gradient of loss_fn(logits [T, vocab]) with respect to it: two dicts
    name → [layers, T, width] (names: ACT_NAMES; the pattern [layers, heads, T, T]; the activations also hold
    "embeds", "nf" and "logits"). loss_fn must map
    a JAX array to a scalar and be hashable (a module-level function, or the same lambda each time: each new
    function compiles again)."""
    tokens = _one_sequence(model, ids)[0]
    acts, grads = activation_grads_of(model.weights, tokens, model.config, loss_fn)
    values = {name: np.asarray(getattr(acts.layers, name)[:, 0]) for name in ACT_NAMES}
    values |= {name: np.asarray(getattr(acts, name)[0]) for name in ("embeds", "nf", "logits")}
    return values, {name: np.asarray(getattr(grads, name)[:, 0]) for name in ACT_NAMES}


@functools.partial(jax.jit, static_argnames=("config", "loss_fn"))
def _weight_grads(weights: Weights, tokens, config: LlamaConfig, loss_fn: LossFn) -> Weights:
    return jax.grad(lambda w: loss_fn(forward(w, tokens, config)[0][0]))(weights.dequantized())


def weight_grads(model: Model, ids: Sequence[int], loss_fn: LossFn) -> Weights:
    """The gradient of loss_fn(logits [T, vocab]) with respect to every weight: a Weights pytree (a tied LM head's
    gradient is part of the embedding's). For weights held in blocks, the gradient with respect to their values
    (f32 arrays of the matrices' shapes)."""
    return _weight_grads(model.weights, _one_sequence(model, ids), model.config, loss_fn)


@functools.partial(jax.jit, static_argnames=("config", "loss_fn"))
def _embedding_grads(weights: Weights, tokens, config: LlamaConfig, loss_fn: LossFn):
    return jax.grad(lambda x: loss_fn(forward_embeds(weights, x, config)[0][0]))(embed(weights, tokens))


def embedding_grads(model: Model, ids: Sequence[int], loss_fn: LossFn) -> np.ndarray:
    """The gradient of loss_fn(logits [T, vocab]) with respect to the input embeddings: [T, dim]."""
    return np.asarray(_embedding_grads(model.weights, _one_sequence(model, ids), model.config, loss_fn)[0])


@functools.partial(jax.jit, static_argnames=("config",))
def logit_lens_of(
    weights: Weights, tokens: Int[ArrayLike, " T"], config: LlamaConfig
) -> tuple[Int[Array, "L T-1"], Float[Array, "L T-1"]]:
    """The functional core of `logit_lens`: for each layer's residual stream y, through the final norm and the
    LM head, the rank of each position's next token (0: the argmax; ties ranked by the strictly larger logits)
    and its log-probability, [L, T-1] each. One layer's [T, V] logits at a time (lax.map)."""
    _, acts = forward(weights, tokens[None], config, keep=("y",))
    targets = tokens[1:]  # [T-1]

    def one_layer(y: Float[Array, "1 T D"]) -> tuple[Array, Array]:
        _, logits = unembed(weights, y, config)  # [1, T, V]
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
    tokens = _one_sequence(model, ids)[0]
    ranks, logps = logit_lens_of(model.weights, tokens, model.config)
    return np.asarray(ranks), np.asarray(logps)


def _one_sequence(model: Model, ids: Sequence[int]) -> jax.Array:
    return jnp.asarray(check_sequence(ids, model.config.vocab)[None], jnp.int32)  # [B=1, T]
