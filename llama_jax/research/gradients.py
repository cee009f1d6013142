"""Gradients through the stored activations, the weights and the input embeddings.

Every activation of `Act` (the spec's n1 q k v qr kr attn a n2 m y and the research sites pattern, mid, hidden,
per layer) is a site of `forward`'s edits. The gradient of a loss with respect to an activation is the gradient
with respect to an intervention of zeros added at that site, which is how `activation_grads` computes them all in
one backward pass. All of this is jit- and vmap-able: the functions here are thin wrappers over the pure
`forward` and `forward_embeds`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from llama_jax.core.config import LlamaConfig
from llama_jax.core.quantized import compute_dtype
from llama_jax.core.weights import Weights
from llama_jax.errors import InvalidArgumentError
from llama_jax.model import Model
from llama_jax.nn.block import ACT_NAMES, Act, act_shape, kept_sites
from llama_jax.nn.head import embed
from llama_jax.passes.checks import check_ids
from llama_jax.passes.forward import Activations, forward, forward_embeds

LossFn = Callable[[Float[Array, "T V"]], Float[Array, ""]]


def zero_interventions(
    config: LlamaConfig, batch: int, length: int, dtype=jnp.float32, names: tuple[str, ...] = ACT_NAMES
) -> Act:
    """An intervention of zeros at the named sites (every site by default), [L, *site's shape] each; None at the
    others (adding it changes nothing)."""
    return Act(
        **{
            n: jnp.zeros((config.layers, *act_shape(n, config, batch, length)), dtype) if n in names else None
            for n in ACT_NAMES
        }
    )


def _sites(names: bool | str | Sequence[str]) -> tuple[str, ...]:
    """The sites whose gradients are asked for (kept_sites' convention: True for all), at least one."""
    sites = kept_sites(names)
    if not sites:
        raise InvalidArgumentError(f"names={names!r} asks for no activation's gradient; give True or site names")
    return sites


@functools.partial(jax.jit, static_argnames=("config", "loss_fn", "native", "names"))
def activation_grads_of(
    weights: Weights,
    tokens: Int[ArrayLike, " T"],
    config: LlamaConfig,
    loss_fn: LossFn,
    native: bool = False,
    names: bool | str | tuple[str, ...] = True,
) -> tuple[Activations, Act]:
    """The functional core of `activation_grads`, for one sequence of ids: the activations of the named sites
    ([L, 1, T, width] each; the pattern [L, 1, N, T, T]) and the gradients of loss_fn(logits [T, V]) with respect to
    them (same shapes; None at the sites not named). jax.vmap it over a batch of sequences; config, loss_fn,
    native (the native block products, whose gradient is the transposed product: `kernels.product`) and names
    (True: every site; else site names, as `forward`'s keep) are static. Naming only the sites needed saves their
    memory, and without "pattern" the attention is the native kernel's."""
    sites = _sites(names)

    def loss(add: Act):
        logits, acts = forward(weights, tokens[None], config, keep=sites, add=add, native=native)
        return loss_fn(logits[0]), acts

    zeros = zero_interventions(config, 1, tokens.shape[0], compute_dtype(weights.emb), sites)
    grads, acts = jax.grad(loss, has_aux=True)(zeros)
    return acts, grads


def activation_grads(
    model: Model, ids: Sequence[int], loss_fn: LossFn, names: bool | str | Sequence[str] = True
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The activations of one sequence at the named sites (True: every site of ACT_NAMES; or names, as `forward`'s
    keep) and the gradient of loss_fn(logits [T, vocab]) with respect to each: two dicts name → [layers, T, width]
    (the pattern [layers, heads, T, T]; the activations also hold "embeds", "nf" and "logits"). loss_fn must map
    a JAX array to a scalar and be hashable (a module-level function, or the same lambda each time: each new
    function compiles again)."""
    sites = _sites(names)
    tokens = one_sequence(model, ids)[0]
    acts, grads = activation_grads_of(model.weights, tokens, model.config, loss_fn, model.native.active, sites)
    # sliced as NumPy views: a JAX slice would copy each array (the logits' [T, vocab] among them) once more
    values = {name: np.asarray(getattr(acts.layers, name))[:, 0] for name in sites}
    values |= {name: np.asarray(getattr(acts, name))[0] for name in ("embeds", "nf", "logits")}
    return values, {name: np.asarray(getattr(grads, name))[:, 0] for name in sites}


def _weight_grads(weights: Weights, tokens, config: LlamaConfig, loss_fn: LossFn, native: bool) -> Weights:
    return jax.grad(lambda w: loss_fn(forward(w, tokens, config, native=native)[0][0]))(weights.dequantized())


_GRADS_JIT = {"static_argnames": ("config", "loss_fn", "native")}
_fresh_weight_grads = jax.jit(_weight_grads, **_GRADS_JIT)
# the same, its result written into the memory of `reuse` (donated; kept although unused, so that it is aliased)
_reused_weight_grads = jax.jit(
    lambda weights, tokens, reuse, config, loss_fn, native: _weight_grads(weights, tokens, config, loss_fn, native),
    donate_argnames=("reuse",),
    keep_unused=True,
    **_GRADS_JIT,
)


def weight_grads(model: Model, ids: Sequence[int], loss_fn: LossFn, reuse: Weights | None = None) -> Weights:
    """The gradient of loss_fn(logits [T, vocab]) with respect to every weight: a Weights pytree (a tied LM head's
    gradient is part of the embedding's). For weights held in blocks, the gradient with respect to their values
    (f32 arrays of the matrices' shapes). reuse: an earlier result of this function for the same model, whose
    memory this result is written into (its arrays are donated: deleted by the call; the first such call compiles
    its own executable). A loop of gradients that passes each result on, once read, touches no fresh memory for
    its results (SmolLM2-135M: 513 MB a call; a 256-token gradient repeated on a 2-core Zen 3 VM: median ~2.4 →
    ~2.2 s, 230,000 → 93,000 page faults a call)."""
    tokens, native = one_sequence(model, ids), model.native.active
    if reuse is None:
        return _fresh_weight_grads(model.weights, tokens, model.config, loss_fn, native)
    _check_reusable(reuse, jax.eval_shape(Weights.dequantized, model.weights))
    return _reused_weight_grads(model.weights, tokens, reuse, model.config, loss_fn, native)


def _check_reusable(reuse: Weights, expected: Weights) -> None:
    """reuse has weight_grads' structure, shapes and dtypes for this model, and its arrays are still alive."""
    got, want = jax.tree_util.tree_flatten_with_path(reuse), jax.tree_util.tree_flatten_with_path(expected)
    if got[1] != want[1]:
        raise InvalidArgumentError(
            "weight_grads(reuse=...): not a weight_grads result of this model (another pytree structure); pass an"
            " earlier result of weight_grads for the same model, or None"
        )
    for (path, array), (_, shape) in zip(got[0], want[0], strict=True):
        name = jax.tree_util.keystr(path)
        if not isinstance(array, jax.Array) or (array.shape, array.dtype) != (shape.shape, shape.dtype):
            raise InvalidArgumentError(
                f"weight_grads(reuse=...): {name} is {getattr(array, 'dtype', type(array).__name__)}"
                f"{list(getattr(array, 'shape', []))}, this model's gradient there is {shape.dtype}{list(shape.shape)};"
                " pass an earlier result of weight_grads for the same model, or None"
            )
        if array.is_deleted():
            raise InvalidArgumentError(
                f"weight_grads(reuse=...): {name} was deleted (given to an earlier call already); pass the latest"
                " result, which holds that memory now"
            )


@functools.partial(jax.jit, static_argnames=("config", "loss_fn", "native"))
def _embedding_grads(weights: Weights, tokens, config: LlamaConfig, loss_fn: LossFn, native: bool):
    return jax.grad(lambda x: loss_fn(forward_embeds(weights, x, config, native=native)[0][0]))(embed(weights, tokens))


def embedding_grads(model: Model, ids: Sequence[int], loss_fn: LossFn) -> np.ndarray:
    """The gradient of loss_fn(logits [T, vocab]) with respect to the input embeddings: [T, dim]."""
    grads = _embedding_grads(model.weights, one_sequence(model, ids), model.config, loss_fn, model.native.active)
    return np.asarray(grads)[0]


def one_sequence(model: Model, ids: Sequence[int]) -> jax.Array:
    """One sequence of ids checked against the model's vocabulary and context, as a [1, T] block."""
    return jnp.asarray(check_ids(ids, model.config)[None], jnp.int32)  # [B=1, T]
