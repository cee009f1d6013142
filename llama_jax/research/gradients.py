"""Gradients through the stored activations, the weights and the input embeddings.

Every activation of `Act` (the spec's n1 q k v qr kr attn a n2 m y and the research sites pattern, mid, hidden,
per layer) is a site of `forward`'s edits. The gradient of a loss with respect to an activation is the gradient
with respect to an intervention of zeros added at that site, which is how `activation_grads` computes them all in
one backward pass. All of this is jit- and vmap-able: the functions here are thin wrappers over the pure
`forward` and `forward_embeds`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int

from llama_jax.core import arrays
from llama_jax.core.config import LlamaConfig
from llama_jax.core.quantized import compute_dtype
from llama_jax.core.weights import LayerWeights, Weights
from llama_jax.errors import InvalidArgumentError
from llama_jax.model import Model
from llama_jax.nn.block import ACT_NAMES, Act, act_shape, kept_sites, model_sites
from llama_jax.nn.head import embed
from llama_jax.nn.linear import WeightTaps
from llama_jax.passes.checks import check_ids
from llama_jax.passes.forward import Activations, forward, forward_embeds

LossFn = Callable[[Float[Array, "T V"]], Float[Array, ""]]


def zero_interventions(
    config: LlamaConfig, batch: int, length: int, dtype=jnp.float32, names: tuple[str, ...] | None = None
) -> Act:
    """An intervention of zeros at the named sites (every site the model computes by default), [L, *site's shape]
    each; None at the others (adding it changes nothing)."""
    names = model_sites(config) if names is None else names
    return Act(
        **{
            n: jnp.zeros((config.layers, *act_shape(n, config, batch, length)), dtype) if n in names else None
            for n in ACT_NAMES
        }
    )


def _sites(names: bool | str | Sequence[str], config: LlamaConfig) -> tuple[str, ...]:
    """The sites whose gradients are asked for (kept_sites' convention: True for all), at least one."""
    sites = kept_sites(names, config)
    if not sites:
        raise InvalidArgumentError(f"names={names!r} asks for no activation's gradient; give True or site names")
    return sites


@functools.partial(jax.jit, static_argnames=("config", "loss_fn", "native", "names", "remat"))
def activation_grads_of(
    weights: Weights,
    tokens: Int[ArrayLike, " T"],
    config: LlamaConfig,
    loss_fn: LossFn,
    native: bool = False,
    names: bool | str | tuple[str, ...] = True,
    remat: bool = False,
) -> tuple[Activations, Act]:
    """The functional core of `activation_grads`, for one sequence of ids: the activations of the named sites
    ([L, 1, T, width] each; the pattern [L, 1, N, T, T]) and the gradients of loss_fn(logits [T, V]) with respect to
    them (same shapes; None at the sites not named). jax.vmap it over a batch of sequences; config, loss_fn,
    native (the native block products, whose gradient is the transposed product: `kernels.product`) and names
    (True: every site; else site names, as `forward`'s keep) are static. Naming only the sites needed saves their
    memory, and without "pattern" the attention is the native kernel's. remat: each layer rematerialised in the
    backward pass (`passes.forward.run_layers`): less memory, a forward pass more."""
    sites = _sites(names, config)

    def loss(add: Act):
        logits, acts = forward(weights, tokens[None], config, keep=sites, add=add, native=native, remat=remat)
        return loss_fn(logits[0]), acts

    zeros = zero_interventions(config, 1, tokens.shape[0], compute_dtype(weights.emb), sites)
    grads, acts = jax.grad(loss, has_aux=True)(zeros)
    return acts, grads


def activation_grads(
    model: Model, ids: Sequence[int], loss_fn: LossFn, names: bool | str | Sequence[str] = True, remat: bool = False
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The activations of one sequence at the named sites (True: every site of ACT_NAMES; or names, as `forward`'s
    keep) and the gradient of loss_fn(logits [T, vocab]) with respect to each: two dicts name → [layers, T, width]
    (the pattern [layers, heads, T, T]; the activations also hold "embeds", "nf" and "logits"). loss_fn must map
    a JAX array to a scalar and be hashable (a module-level function, or the same lambda each time: each new
    function compiles again). remat: each layer rematerialised in the backward pass, which then keeps each
    layer's input instead of its intermediates and computes the layers' forward pass twice (a Llama-3.1-8B
    Q4_K_M file's gradients at every layer's output over 256 tokens: peak RSS file + 2.9 → 1.5 GB, 54 → 70 s)."""
    sites = _sites(names, model.config)
    tokens = one_sequence(model, ids)[0]
    native = model.native.active
    acts, grads = activation_grads_of(model.weights, tokens, model.config, loss_fn, native, sites, remat)
    # sliced as NumPy views: a JAX slice would copy each array (the logits' [T, vocab] among them) once more
    values = {name: np.asarray(getattr(acts.layers, name))[:, 0] for name in sites}
    values |= {name: np.asarray(getattr(acts, name))[0] for name in ("embeds", "nf", "logits")}
    return values, {name: np.asarray(getattr(grads, name))[:, 0] for name in sites}


def _weight_grads(
    weights: Weights, tokens, config: LlamaConfig, loss_fn: LossFn, native: bool, chosen: tuple[int, ...] | None
) -> Weights | LayerWeights:
    if chosen is None:  # every weight, the blocks widened
        return jax.grad(lambda w: loss_fn(forward(w, tokens, config, native=native)[0][0]))(weights.dequantized())

    vectors = {  # the norms' gains, and the biases and per-head norms the config has: [L, width] each, small
        f: getattr(weights.layers, f)
        for f in arrays.LAYER
        if f not in arrays.LAYER_MATRICES and getattr(weights.layers, f) is not None
    }

    def loss(taps: WeightTaps, vectors: dict[str, Array]) -> Array:
        w = dataclasses.replace(weights, layers=dataclasses.replace(weights.layers, **vectors))
        return loss_fn(forward(w, tokens, config, native=native, taps=taps, remat=True)[0][0])

    taps = WeightTaps.zeros(weights.layers, chosen)
    grads, vector_grads = jax.grad(loss, argnums=(0, 1))(taps, vectors)
    rows = jnp.asarray(chosen, jnp.int32)
    matrices = {f: getattr(grads, f) for f in arrays.LAYER_MATRICES}
    return LayerWeights(**{f: g[rows] for f, g in vector_grads.items()}, **matrices)


_GRADS_JIT = {"static_argnames": ("config", "loss_fn", "native", "chosen")}
_fresh_weight_grads = jax.jit(_weight_grads, **_GRADS_JIT)
# the same, its result written into the memory of `reuse` (donated; kept although unused, so that it is aliased)
_reused_weight_grads = jax.jit(
    lambda weights, tokens, reuse, config, loss_fn, native, chosen: _weight_grads(
        weights, tokens, config, loss_fn, native, chosen
    ),
    donate_argnames=("reuse",),
    keep_unused=True,
    **_GRADS_JIT,
)


def weight_grads(
    model: Model,
    ids: Sequence[int],
    loss_fn: LossFn,
    reuse: Weights | LayerWeights | None = None,
    layers: Sequence[int] | None = None,
) -> Weights | LayerWeights:
    """The gradient of loss_fn(logits [T, vocab]) with respect to every weight: a Weights pytree (a tied LM head's
    gradient is part of the embedding's). For weights held in blocks, the gradient with respect to their values
    (f32 arrays of the matrices' shapes), which widens every block matrix at once (an 8B Q4_K_M model: 32 GB).

    layers: the gradients of these layers' weights only (indices, in the order given), as a LayerWeights of
    [len(layers), ...] arrays (each matrix f32, [C, out, in]; the norms' gains, and the biases and per-head norms
    the config has), on the model as held: no weight
    is widened but where it is multiplied, a layer at a time, and the backward pass keeps one f32 array per
    matrix of the chosen layers besides each layer's input, the layers rematerialised (`nn.linear.WeightTaps`,
    `passes.forward.run_layers`' remat): a Llama-3.1-8B Q4_K_M file's layer over 256 tokens at the file + 2.7 GB.

    reuse: an earlier result of this function for the same model and layers, whose memory this result is
    written into (its arrays are donated: deleted by the call; the first such call compiles its own executable).
    A loop of gradients that passes each result on, once read, touches no fresh memory for its results
    (SmolLM2-135M: 513 MB a call; a 256-token gradient repeated on a 2-core Zen 3 VM: median ~2.4 → ~2.2 s,
    230,000 → 93,000 page faults a call)."""
    tokens, native = one_sequence(model, ids), model.native.active
    chosen = None if layers is None else _chosen_layers(layers, model.config)
    if reuse is None:
        return _fresh_weight_grads(model.weights, tokens, model.config, loss_fn, native, chosen)
    static = {"config": model.config, "loss_fn": loss_fn, "native": native, "chosen": chosen}
    expected = jax.eval_shape(functools.partial(_weight_grads, **static), model.weights, tokens)
    _check_reusable(reuse, expected)
    return _reused_weight_grads(model.weights, tokens, reuse, model.config, loss_fn, native, chosen)


def _chosen_layers(layers: Sequence[int], config: LlamaConfig) -> tuple[int, ...]:
    """weight_grads' layers, checked: distinct layer indices, at least one."""
    chosen = tuple(layers) if not isinstance(layers, int | str) else None
    if not chosen or any(isinstance(i, bool) or not isinstance(i, int | np.integer) for i in chosen):
        raise InvalidArgumentError(f"layers={layers!r}: give a sequence of layer indices (ints), at least one")
    chosen = tuple(int(i) for i in chosen)
    wrong = [i for i in chosen if not 0 <= i < config.layers]
    if wrong or len(set(chosen)) != len(chosen):
        what = f"{wrong} outside 0..{config.layers - 1}" if wrong else "an index given twice"
        raise InvalidArgumentError(f"layers={layers!r}: {what}; give distinct indices of the model's layers")
    return chosen


def _check_reusable(reuse: Weights | LayerWeights, expected: Weights | LayerWeights) -> None:
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
    return jax.grad(lambda x: loss_fn(forward_embeds(weights, x, config, native=native)[0][0]))(
        embed(weights, tokens, config)
    )


def embedding_grads(model: Model, ids: Sequence[int], loss_fn: LossFn) -> np.ndarray:
    """The gradient of loss_fn(logits [T, vocab]) with respect to the input embeddings: [T, dim]."""
    grads = _embedding_grads(model.weights, one_sequence(model, ids), model.config, loss_fn, model.native.active)
    return np.asarray(grads)[0]


def one_sequence(model: Model, ids: Sequence[int]) -> jax.Array:
    """One sequence of ids checked against the model's vocabulary and context, as a [1, T] block."""
    return jnp.asarray(check_ids(ids, model.config)[None], jnp.int32)  # [B=1, T]
