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

from llama_jax.core.config import LlamaConfig
from llama_jax.core.kv_cache import KVCache
from llama_jax.core.weights import Weights
from llama_jax.errors import InvalidArgumentError
from llama_jax.nn.attention import causal_mask, layer_attention
from llama_jax.nn.block import Act, Edits, Patch, attention_and_mlp, attention_inputs, kept_sites, only
from llama_jax.nn.head import embed, unembed
from llama_jax.nn.linear import LayerProducts, WeightTaps
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
    taps: WeightTaps | None = None,
    remat: bool = False,
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
    real: the real positions of each sequence's block (default T), the rest padding, which a ring cache does not
    write (`KVCache.write_and_read`: the cache says where its slots are, ring or linear). taps: the products of
    chosen layers tapped for their weight gradients (`WeightTaps`). remat (static): each layer rematerialised in
    a backward pass (`jax.checkpoint` over the layer): a gradient keeps each layer's input instead of its
    intermediates and computes each layer's forward pass again (a Llama-3.1-8B Q4_K_M file's one-layer weight
    gradient over 256 tokens: peak RSS file + 4.75 → 2.66 GB, 59 → 69 s on a 2-core Zen 4)."""
    b, t = x.shape[:2]
    real = jnp.full(b, t, jnp.int32) if real is None else real  # [B]
    ends = jnp.take_along_axis(positions, (real - 1)[:, None], axis=1)[:, 0] + 1  # [B]: each sequence's length
    cos, sin = rope_tables(positions, config, x.dtype, ends)  # [B, T, half] each
    step = cache is not None and t == 1  # one position per sequence against the cache: a decode step
    seen, slots = (positions, t) if cache is None else cache.queries(positions, window)  # [B, T], S
    mask = causal_mask(seen, slots, config.sliding_window)  # [B, T, S]
    products = LayerProducts(weights.layers, native, step, taps, config.precision)
    kept_pattern = "pattern" in keep

    def layer(carry, xs):
        x, cache = carry
        lw, i, layer_edits = xs
        lw, project = products.layer(lw, i)  # layer i's weights, and its products
        rope = jnp.asarray(config.rope_layers)[i] if config.nope_layers else None  # whether layer i takes RoPE
        inputs = attention_inputs(lw, x, cos, sin, config, layer_edits, project, rope)
        k_new, v_new = _heads_first(inputs.kr), _heads_first(inputs.v.reshape(inputs.kr.shape))  # [B, K, T, H]
        if cache is None:
            keys, values = k_new, v_new
        else:
            cache, keys, values = cache.write_and_read(i, k_new, v_new, real, window)  # [B, K, S, H] each
        read = (cache, i, positions[:, 0]) if step else None
        attend = layer_attention(
            keys, values, mask, seen, config.sliding_window, kept_pattern, native, read, config.attention_scale
        )
        act = attention_and_mlp(lw, x, inputs, attend, config, layer_edits, project)
        return (act.y, cache), (only(act, keep) if keep else None)

    layers = products.scanned()
    if depth is not None and depth != config.layers:
        if cache is not None or edits is not None or not 1 <= depth <= config.layers:
            raise InvalidArgumentError(f"depth={depth} takes 1..{config.layers} layers, without a cache or edits")
        layers = jax.tree.map(lambda a: a[:depth], layers)  # [depth, ...] each
    xs = (layers, jnp.arange(depth or config.layers), edits)
    (x, cache), acts = lax.scan(jax.checkpoint(layer) if remat else layer, (x, cache), xs)
    return x, cache, acts


def forward(
    weights: Weights,
    tokens: Int[ArrayLike, "B T"],
    config: LlamaConfig,
    keep: bool | str | tuple[str, ...] = False,
    add: Act | None = None,
    patch: Patch | None = None,
    native: bool = False,
    taps: WeightTaps | None = None,
    remat: bool = False,
    lengths: Int[ArrayLike, " B"] | None = None,
) -> tuple[Float[Array, "B T V"], Activations | None]:
    """The logits of every position of B sequences of T tokens from position 0 (no cache), and with keep (static)
    the activations: True for every site, or the names of the sites to store (a tuple; the others are None and
    cost no memory). Pure: jit-, grad- and vmap-able; ids must lie in [0, vocab) (checked at the Python
    boundary: `check_tokens`).

    add: interventions added to the activations as they are computed (an Act of [L, B, T, width] arrays, None
    for the sites left alone); patch: activations replaced at chosen layers and positions (see `Patch`). native
    (static): the products by the native block kernel (`kernels.product`; a Model's `native`), else XLA's. taps:
    chosen layers' products tapped for their weight gradients (`WeightTaps`); remat (static): the layers
    rematerialised in a backward pass (`run_layers`). lengths: each sequence's real tokens (default T; the rest
    padding after them), which only longrope reads (its factors by each sequence's length)."""
    x = embed(weights, tokens, config)
    return forward_embeds(weights, x, config, keep, add, patch, native, taps, remat, lengths)


def forward_embeds(
    weights: Weights,
    x: Float[Array, "B T D"],
    config: LlamaConfig,
    keep: bool | str | tuple[str, ...] = False,
    add: Act | None = None,
    patch: Patch | None = None,
    native: bool = False,
    taps: WeightTaps | None = None,
    remat: bool = False,
    lengths: Int[ArrayLike, " B"] | None = None,
) -> tuple[Float[Array, "B T V"], Activations | None]:
    """`forward` from the input embeddings x instead of token ids (for gradients with respect to them)."""
    weights.assert_matches(config)  # chex, at trace time: shapes the config derives (`arrays`)
    positions = positions_from_zero(x.shape[0], x.shape[1])  # [B, T]
    edits = None if add is None and patch is None else Edits(add, patch)
    kept = kept_sites(keep, config)
    embeds = x
    real = None if lengths is None else jnp.asarray(lengths, jnp.int32)  # [B]
    x, _, acts = run_layers(weights, x, positions, config, None, kept, edits, native, real=real, taps=taps, remat=remat)
    nf, logits = unembed(weights, x, config, native)  # [B, T, D], [B, T, V]
    return logits, (Activations(acts, embeds, nf, logits) if kept else None)


def last_stream(
    weights: Weights,
    tokens: Int[ArrayLike, "B T"],
    config: LlamaConfig,
    native: bool = False,
    lengths: Int[Array, " B"] | None = None,
):
    """The last layer's output [B, T, D] (before the final norm) of B sequences from position 0, for passes that
    apply the head themselves (scoring: only at the scored positions). native (static) and lengths: as for
    `forward`."""
    b, t = tokens.shape
    x = embed(weights, tokens, config)
    x, _, _ = run_layers(weights, x, positions_from_zero(b, t), config, None, (), None, native, real=lengths)
    return x


def positions_from_zero(b: int, t: int) -> Int[Array, "B T"]:
    return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]: every sequence from position 0
