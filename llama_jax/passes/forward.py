"""The layer scan and the pure forward pass: a whole block of tokens from position 0, every activation on request.

`run_layers` runs the stacked layers with one `lax.scan` (compile time independent of depth) over `nn.block`'s two
halves, attending to the block's own keys or to a KV cache it writes (`passes.cached`). `forward` is pure: jit-,
grad- and vmap-able, with interventions (`add`, `patch`) at every site.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, ArrayLike, Float, Int

from llama_jax import kernels
from llama_jax.core import arrays
from llama_jax.core.config import LlamaConfig
from llama_jax.core.kv_cache import KVCache, ring_view, ring_view_slots, write_layer, write_ring_layer
from llama_jax.core.quantized import Blocks, Mixed, SlicedLayer
from llama_jax.core.weights import Weights
from llama_jax.errors import InvalidArgumentError
from llama_jax.nn.attention import causal_attention, causal_mask
from llama_jax.nn.block import (
    Act,
    Edits,
    Patch,
    attention_and_mlp,
    attention_inputs,
    kept_sites,
    native_projection,
    only,
    projection,
)
from llama_jax.nn.head import embed, unembed
from llama_jax.nn.rope import rope_tables


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Activations:
    """The kept sites of every layer's Act stacked [L, B, T, width] (the pattern [L, B, N, T, T]; a site not kept
    is None), the input embeddings embeds [B, T, D] (the first layer's input), the final norm nf [B, T, D] and
    the logits [B, T, V]."""

    layers: Act
    embeds: Float[Array, "*B T D"]
    nf: Float[Array, "*B T D"]
    logits: Float[Array, "*B T V"]


def _heads_first(x: Float[Array, "B T K H"]) -> Float[Array, "B K T H"]:
    return jnp.swapaxes(x, 1, 2)


def run_layers(
    weights: Weights,
    x: Float[Array, "B T D"],
    positions: Int[Array, "B T"],
    config: LlamaConfig,
    cache: KVCache | None,
    keep: tuple[str, ...],
    edits: Edits | None = None,
    native: bool = False,
    window: int | None = None,
    depth: int | None = None,
    real: Int[Array, " B"] | None = None,
) -> tuple[Float[Array, "B T D"], KVCache | None, Act | None]:
    """The layers over x at `positions`. Without a cache the queries attend to the block's own keys; with one, the
    keys and values are written at slots cache.length.. and the queries attend to the cache's slots; either way
    causally (`causal_mask`: a query sees the slots up to its own position). keep: the sites
    whose stacked activations to return (static; none: None). edits: every layer's edits, stacked [L, ...] like
    the activations. native (static): the native kernels: a decode step's (one position per sequence, with a cache)
    on the stacked weights and the cache in place, else the block product on each layer's weights and, where the
    pattern is not edited, the block attention that skips the masked slots (a kept pattern is then XLA's
    probabilities, beside it: the outputs are the same bits whether it is kept or not).
    window (static): the queries attend to cache slots 0..window-1 only (at least every written slot; the
    cache's capacity by default), so attention costs what the filled part of the cache needs. depth (static): run
    the first `depth` layers only (no cache; the kept sites then stack [depth, ...]), for passes that stop early.
    A ring cache (`KVCache.ring`) is read through `ring_view` (or in place by a decode step's kernel) and gets
    the first real[b] positions of each sequence written (a block's padding is not; one position: it is written)."""
    cos, sin = rope_tables(positions, config, x.dtype)  # [B, T, half] each
    stacked = None if cache is None else (cache.k, cache.v)
    step = native and cache is not None and x.shape[1] == 1  # the decode kernels
    ring = cache is not None and cache.ring
    if ring:  # the queries at their slots of `ring_view`: position - base
        real = jnp.full(x.shape[0], x.shape[1], jnp.int32) if real is None else real  # [B]
        held = jnp.minimum(cache.length, cache.capacity)  # [B]
        seen = held[:, None] + jnp.arange(x.shape[1], dtype=jnp.int32)  # [B, T]
        slots = ring_view_slots(cache.capacity, x.shape[1])
    else:
        seen = positions  # [B, T]: a linear cache's slots are its positions
        slots = x.shape[1] if cache is None else (window or cache.capacity)  # the key slots attended to
    mask = causal_mask(seen, slots, config.sliding_window)  # [B, T, S]

    layers = weights.layers
    held = {f: m for f in arrays.LAYER if isinstance(m := getattr(layers, f), (Blocks, Mixed))}  # see `HeldLayer`
    layers = dataclasses.replace(layers, **dict.fromkeys(held))  # the scanned weights: float arrays
    # the float matrices' stacks, for the native products to read each layer in place (`SlicedLayer`)
    floats = {} if not native or step else {f: getattr(layers, f) for f in arrays.LAYER_MATRICES if f not in held}

    def layer(carry, xs):
        x, keys_values = carry
        lw, i, layer_edits = xs
        in_place = {f: SlicedLayer(getattr(lw, f), stack, i) for f, stack in floats.items()}
        lw = dataclasses.replace(lw, **{f: m.at(i) for f, m in held.items()}, **in_place)  # layer i's weights
        project = native_projection(weights.layers, i) if step else projection(lw, native)
        inputs = attention_inputs(lw, x, cos, sin, config, layer_edits, project)
        k_new, v_new = _heads_first(inputs.kr), _heads_first(inputs.v.reshape(inputs.kr.shape))  # [B, K, T, H]
        if keys_values is None:
            keys, values = k_new, v_new
        elif ring:
            if not step:  # read before the block is written over the slots it may need
                keys, values = ring_view(*keys_values, i, cache.length, k_new, v_new)  # [B, K, R, H] each
            if x.shape[1] == 1:
                slot = cache.length % cache.capacity  # [B]: position p at slot p mod S
                keys_values = write_layer(*keys_values, i, slot, k_new, v_new)  # [L, B, K, S, H] each
            else:
                keys_values = write_ring_layer(*keys_values, i, cache.length, real, k_new, v_new)
        else:
            keys_values = write_layer(*keys_values, i, cache.length, k_new, v_new)  # [L, B, K, S, H] each
            keys, values = keys_values[0][i, :, :, :window], keys_values[1][i, :, :, :window]  # [B, K, W, H]
        if step:  # one position per sequence: the native kernel reads the cache in place

            def attend(qr, _edit):  # [B, 1, N, H] -> [B, 1, N, H]; no pattern (nor edits) here
                if ring:  # slots 0..min(position, S - 1), every one inside the window (S is the window)
                    last = jnp.minimum(positions[:, 0], cache.capacity - 1)  # [B]
                    out = kernels.attend(*keys_values, i, last, qr[:, 0])  # [B, N, H]
                else:
                    out = kernels.attend(*keys_values, i, positions[:, 0], qr[:, 0], config.sliding_window)
                return out[:, None], None

        else:

            def attend(qr, edit):
                kept, sliding = "pattern" in keep, config.sliding_window
                return causal_attention(qr, keys, values, mask, seen, edit, kept, native, sliding)

        act = attention_and_mlp(lw, x, inputs, attend, config, layer_edits, project)
        return (act.y, keys_values), (only(act, keep) if keep else None)

    if depth is not None and depth != config.layers:
        if cache is not None or edits is not None or not 1 <= depth <= config.layers:
            raise InvalidArgumentError(f"depth={depth} takes 1..{config.layers} layers, without a cache or edits")
        layers = jax.tree.map(lambda a: a[:depth], layers)  # [depth, ...] each
    xs = (layers, jnp.arange(depth or config.layers), edits)
    (x, stacked), acts = lax.scan(layer, (x, stacked), xs)
    if cache is not None:
        cache = dataclasses.replace(cache, k=stacked[0], v=stacked[1])
    return x, cache, acts


def forward(
    weights: Weights,
    tokens: Int[ArrayLike, "B T"],
    config: LlamaConfig,
    keep: bool | str | tuple[str, ...] = False,
    add: Act | None = None,
    patch: Patch | None = None,
    native: bool = False,
) -> tuple[Float[Array, "B T V"], Activations | None]:
    """The logits of every position of B sequences of T tokens from position 0 (no cache), and with keep (static)
    the activations: True for every site, or the names of the sites to store (a tuple; the others are None and
    cost no memory). Pure: jit-, grad- and vmap-able; ids must lie in [0, vocab) (checked at the Python
    boundary: `check_tokens`).

    add: interventions added to the activations as they are computed (an Act of [L, B, T, width] arrays, None
    for the sites left alone); patch: activations replaced at chosen layers and positions (see `Patch`). native
    (static): the products by the native block kernel (`kernels.product`; a Model's `native`), else XLA's."""
    return forward_embeds(weights, embed(weights, tokens), config, keep, add, patch, native)


def forward_embeds(
    weights: Weights,
    x: Float[Array, "B T D"],
    config: LlamaConfig,
    keep: bool | str | tuple[str, ...] = False,
    add: Act | None = None,
    patch: Patch | None = None,
    native: bool = False,
) -> tuple[Float[Array, "B T V"], Activations | None]:
    """`forward` from the input embeddings x instead of token ids (for gradients with respect to them)."""
    weights.assert_matches(config)  # chex, at trace time: shapes the config derives (`arrays`)
    positions = positions_from_zero(x.shape[0], x.shape[1])  # [B, T]
    edits = None if add is None and patch is None else Edits(add, patch)
    kept = kept_sites(keep)
    embeds = x
    x, _, acts = run_layers(weights, x, positions, config, None, kept, edits, native)
    nf, logits = unembed(weights, x, config, native)  # [B, T, D], [B, T, V]
    return logits, (Activations(acts, embeds, nf, logits) if kept else None)


def last_stream(weights: Weights, tokens: Int[ArrayLike, "B T"], config: LlamaConfig, native: bool = False):
    """The last layer's output [B, T, D] (before the final norm) of B sequences from position 0, for passes that
    apply the head themselves (scoring: only at the scored positions). native (static): as for `forward`."""
    b, t = tokens.shape
    x, _, _ = run_layers(weights, embed(weights, tokens), positions_from_zero(b, t), config, None, (), None, native)
    return x


def positions_from_zero(b: int, t: int) -> Int[Array, "B T"]:
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]: every sequence from position 0
