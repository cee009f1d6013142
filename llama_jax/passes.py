"""The forward passes: a whole block of tokens (with every activation), prefill into a KV cache, one decode step.

All three run the stacked layers with one `lax.scan` (compile time independent of depth) over `block`'s two
halves. `forward` is pure (jit-, grad- and vmap-able); `prefill` and `decode_step` write the cache, so they are
jitted with the cache donated (updated in place), their executables kept on disk (`executables`), and check on
the host first: a write at or past the capacity raises CapacityError and a token id outside [0, vocab) raises
TokenIdError, where `dynamic_update_slice` and the embedding gather would otherwise clamp silently. Their pure
body `extend` carries the same checks inside the graph (checkify), for composing it into other jitted code;
`throw` raises a failed one as the package's error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import checkify
from jaxtyping import Array, ArrayLike, Bool, Float, Int

from llama_jax import kernels
from llama_jax.buckets import bucket
from llama_jax.cache import ROOM_CHECK, KVCache, check_room_traced, write_layer
from llama_jax.config import LlamaConfig
from llama_jax.errors import CapacityError, InvalidArgumentError, LlamaJaxError, TokenIdError
from llama_jax.executables import persistent_jit
from llama_jax.nn.attention import attention_with_pattern
from llama_jax.nn.block import Act, Edits, Patch, Project, attention_and_mlp, attention_inputs, kept_sites, only
from llama_jax.nn.linear import linear
from llama_jax.nn.norm import rms_norm
from llama_jax.nn.rope import rope_tables
from llama_jax.quantized import dense, take_rows
from llama_jax.weights import LayerWeights, Weights

MIN_WINDOW = 256  # decode attends to at least this many slots: one compilation up to 256 positions
# how prefill's and decode_step's bodies are jitted (the tests count their traces under the same options)
EXTEND_JIT = {"static_argnames": ("config", "native", "window"), "donate_argnames": ("cache",)}

# The in-graph checks' format strings, and the error each one's failure raises (see `throw`).
WINDOW_CHECK = "attention window {w} is shorter than the positions written; attend to at least max(length) + T slots"
TOKEN_CHECK = "token id {id} is outside the vocabulary [0, {vocab})"
_CHECKS: dict[str, type[LlamaJaxError]] = {
    ROOM_CHECK: CapacityError,
    WINDOW_CHECK: CapacityError,
    TOKEN_CHECK: TokenIdError,
}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Activations:
    """The kept sites of every layer's Act stacked [L, B, T, width] (the pattern [L, B, N, T, T]; a site not kept
    is None), the input embeddings embeds [B, T, D] (the first layer's input), the final norm nf [B, T, D] and
    the logits [B, T, V]."""

    layers: Act
    embeds: Float[Array, "*B T dim"]
    nf: Float[Array, "*B T dim"]
    logits: Float[Array, "*B T vocab"]


def _heads_first(x: Float[Array, "B T K H"]) -> Float[Array, "B K T H"]:
    return jnp.swapaxes(x, 1, 2)


def _run_layers(
    weights: Weights,
    x: Float[Array, "B T D"],
    positions: Int[Array, "B T"],
    mask: Bool[Array, "B T S"],
    config: LlamaConfig,
    cache: KVCache | None,
    keep: tuple[str, ...],
    edits: Edits | None = None,
    native: bool = False,
    window: int | None = None,
) -> tuple[Float[Array, "B T D"], KVCache | None, Act | None]:
    """The layers over x. Without a cache the queries attend to the block's own keys; with one, the keys and
    values are written at slots cache.length.. and the queries attend to the cache's slots. keep: the sites
    whose stacked activations to return (static; none: None). edits: every layer's edits, stacked [L, ...] like
    the activations. native (static; one position per sequence): the matrix products run the native kernel on
    the stacked weights.
    window (static): the queries attend to cache slots 0..window-1 only (at least every written slot; the
    cache's capacity by default), so attention costs what the filled part of the cache needs."""
    cos, sin = rope_tables(positions, config, x.dtype)  # [B, T, half] each
    stacked = None if cache is None else (cache.k, cache.v)

    def layer(carry, xs):
        x, kv = carry
        lw, i, layer_edits = xs
        project = _native_projection(weights.layers, i) if native else None
        inputs = attention_inputs(lw, x, cos, sin, config, layer_edits, project)
        k_new, v_new = _heads_first(inputs.kr), _heads_first(inputs.v.reshape(inputs.kr.shape))  # [B, K, T, H]
        if kv is None:
            keys, values = k_new, v_new
        else:
            kv = write_layer(*kv, i, cache.length, k_new, v_new)  # [L, B, K, S, H] each
            keys, values = kv[0][i, :, :, :window], kv[1][i, :, :, :window]  # [B, K, W, H]
        if native:  # one position per sequence: the native kernel reads the cache in place

            def attend(qr, _edit):  # [B, 1, N, H] -> [B, 1, N, H]; no pattern (nor edits) here
                return kernels.attend(kv[0], kv[1], i, positions[:, 0], qr[:, 0])[:, None], None

        else:

            def attend(qr, edit):
                return attention_with_pattern(qr, keys, values, mask, edit)

        act = attention_and_mlp(lw, x, inputs, attend, config, layer_edits, project)
        return (act.y, kv), (only(act, keep) if keep else None)

    xs = (weights.layers, jnp.arange(config.layers), edits)
    (x, stacked), acts = lax.scan(layer, (x, stacked), xs)
    if cache is not None:
        cache = KVCache(stacked[0], stacked[1], cache.length)
    return x, cache, acts


def _native_projection(stacked: LayerWeights, layer: Int[Array, ""]) -> Project:
    """Products of one position per sequence by layer `layer`'s weights, read in place by the native kernel."""

    def project(x: Float[Array, "B 1 I"], name: str) -> Float[Array, "B 1 O"]:
        return kernels.matvec(getattr(stacked, name), layer, x[:, 0])[:, None]

    return project


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


def forward(
    weights: Weights,
    tokens: Int[ArrayLike, "B T"],
    config: LlamaConfig,
    keep: bool | str | tuple[str, ...] = False,
    add: Act | None = None,
    patch: Patch | None = None,
) -> tuple[Float[Array, "B T V"], Activations | None]:
    """The logits of every position of B sequences of T tokens from position 0 (no cache), and with keep (static)
    the activations: True for every site, or the names of the sites to store (a tuple; the others are None and
    cost no memory). Pure: jit-, grad- and vmap-able; ids must lie in [0, vocab) (checked at the Python
    boundary: `check_tokens`).

    add: interventions added to the activations as they are computed (an Act of [L, B, T, width] arrays, None
    for the sites left alone); patch: activations replaced at chosen layers and positions (see `Patch`)."""
    return forward_embeds(weights, embed(weights, tokens), config, keep, add, patch)


def forward_embeds(
    weights: Weights,
    x: Float[Array, "B T D"],
    config: LlamaConfig,
    keep: bool | str | tuple[str, ...] = False,
    add: Act | None = None,
    patch: Patch | None = None,
) -> tuple[Float[Array, "B T V"], Activations | None]:
    """`forward` from the input embeddings x instead of token ids (for gradients with respect to them)."""
    weights.assert_matches(config)  # chex, at trace time: shapes the config derives (`arrays`)
    b, t, _ = x.shape
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))  # [T, S=T]
    mask = jnp.broadcast_to(causal, (b, t, t))  # [B, T, S]
    edits = None if add is None and patch is None else Edits(add, patch)
    kept = kept_sites(keep)
    embeds = x
    x, _, acts = _run_layers(weights, x, positions, mask, config, None, kept, edits)
    nf, logits = unembed(weights, x, config)  # [B, T, D], [B, T, V]
    return logits, (Activations(acts, embeds, nf, logits) if kept else None)


def extend(
    weights: Weights,
    cache: KVCache,
    tokens: Int[ArrayLike, "B T"],
    n: Int[Array, " B"],
    config: LlamaConfig,
    window: int | None = None,
) -> tuple[Float[Array, "B V"], KVCache]:
    """T tokens of sequence b written at slots length[b]..length[b]+T-1, its first n[b] real and the rest padding
    (whose slots its later writes overwrite); the logits after each sequence's last real token; each length grown
    by its n[b]. Sequence b's positions are its slots: padding never shifts them.

    Pure, with checkify checks on the capacity, the attention window and the token ids: call it under
    `checkify.checkify` (as `prefill` and `decode_step` do) to compose it into other jitted code. window
    (static): attend to cache slots 0..window-1 only (default: all)."""
    check_room_traced(cache, tokens.shape[1])
    if window is not None:
        checkify.check(
            jnp.max(cache.length) + tokens.shape[1] <= window,
            WINDOW_CHECK,
            w=jnp.int32(window),
        )
    _check_tokens_traced(tokens, config.vocab)
    return extend_unchecked(weights, cache, tokens, n, config, window=window)


def extend_unchecked(
    weights: Weights,
    cache: KVCache,
    tokens: Int[ArrayLike, "B T"],
    n: Int[Array, " B"],
    config: LlamaConfig,
    native: bool = False,
    window: int | None = None,
) -> tuple[Float[Array, "B V"], KVCache]:
    """`extend` without its checks, for loops whose caller has checked the room and draws the ids itself.
    native (static): the native kernels (see `kernels`) for the LM head (one position per sequence), and for the
    layers of a one-token step (a longer block runs XLA's products). window (static): the
    cache slots attended to; the caller guarantees window ≥ max(length) + T (see `attention_window`)."""
    weights.assert_matches(config)  # chex, at trace time: shapes the config derives (`arrays`)
    cache.assert_matches(config)
    t = tokens.shape[1]
    positions = cache.length[:, None] + jnp.arange(t, dtype=jnp.int32)  # [B, T]
    slots = jnp.arange(cache.capacity, dtype=jnp.int32)  # [S]
    mask = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]: causal, within each sequence's positions
    x, cache, _ = _run_layers(
        weights,
        embed(weights, tokens),
        positions,
        mask[:, :, :window],
        config,
        cache,
        (),
        None,
        native and t == 1,
        window,
    )
    last = jnp.take_along_axis(x, (n - 1)[:, None, None], axis=1)  # [B, 1, D]
    _, logits = unembed(weights, last, config, native)  # [B, 1, V]
    return logits[:, 0], KVCache(cache.k, cache.v, cache.length + n)


def _check_tokens_traced(tokens: Int[ArrayLike, "*B"], vocab: int) -> None:
    bad = (tokens < 0) | (tokens >= vocab)
    checkify.check(
        ~jnp.any(bad),
        TOKEN_CHECK,
        id=jnp.where(jnp.any(bad), tokens.ravel()[jnp.argmax(bad.ravel())], 0),
        vocab=jnp.int32(vocab),
    )


def check_tokens(tokens: np.ndarray, vocab: int) -> None:
    """Raises TokenIdError naming the first id outside [0, vocab) (host-side, before any compute)."""
    tokens = np.asarray(tokens)
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise InvalidArgumentError(f"token ids must be integers, got an array of {tokens.dtype}")
    bad = (tokens < 0) | (tokens >= vocab)
    if bad.any():
        raise TokenIdError(
            f"token id {int(tokens[bad][0])} is outside the vocabulary [0, {vocab}); ids must lie in 0..{vocab - 1}"
        )


def check_sequence(ids: object, vocab: int) -> np.ndarray:
    """One sequence of ids as a 1-D array: InvalidArgumentError unless it is a non-empty 1-D sequence of integers,
    TokenIdError unless its ids lie inside the vocabulary."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0:
        raise InvalidArgumentError(f"expected a non-empty 1-D sequence of token ids, got shape {ids.shape}")
    check_tokens(ids, vocab)
    return ids


def throw(err: checkify.Error) -> None:
    """Raises the error of a failed check of `extend` composed under checkify (None when no check failed), as
    the package's error class, chosen by which check failed: checkify returns the failure
    with the format string the check was declared with (`fmt_string`), and each check declares its own constant
    (ROOM_CHECK, WINDOW_CHECK, TOKEN_CHECK), so the kind is looked up exactly in `_CHECKS`; the formatted text
    is only the message. A failure of a check not declared here (none is) comes out as JAX's own error."""
    failed = err.get_exception()
    if failed is None:
        return
    kind = _CHECKS.get(getattr(failed, "fmt_string", None))
    if kind is None:
        err.throw()
    raise kind(failed.fmt_string.format(*failed.args, **failed.kwargs))


@persistent_jit(**EXTEND_JIT)
def _extend_jit(weights, cache, tokens, n, config, native, window):
    return extend_unchecked(weights, cache, tokens, n, config, native, window)


def attention_window(written: int, new: int, capacity: int, minimum: int = MIN_WINDOW) -> int:
    """The cache slots a step must attend to, bucketed (a power of two, at least `minimum`, at most the
    capacity) so that a growing cache compiles a few times, not once per length."""
    return bucket(max(written + new, minimum), capacity)


def prefill(
    weights: Weights,
    cache: KVCache,
    tokens: Int[ArrayLike, "B T"],
    config: LlamaConfig,
    n: int | Sequence[int] | None = None,
    native: bool | None = None,
) -> tuple[Float[Array, "B V"], KVCache]:
    """Writes a block of T tokens per sequence into the cache (one pass per layer, causal mask) and returns the
    logits after each sequence's last real token and the cache. n: the real tokens of each sequence (one number
    for all, or one per sequence; default T), the rest of its row padding, so that prompts of different lengths
    share a batch and a new length does not recompile. Attention reads only the part of the cache written so far
    (a bucket of it). native: the LM head by the native kernel (see `uses_native`). Compiled once per (B, T,
    capacity, window bucket); the cache is donated."""
    tokens = np.asarray(tokens)
    b, t = tokens.shape
    counts = np.full(b, t, dtype=np.int32) if n is None else np.broadcast_to(np.asarray(n, dtype=np.int32), (b,))
    if np.any(counts < 1) or np.any(counts > t):
        raise InvalidArgumentError(f"each row of a prefill of {t} slots holds 1 to {t} real tokens, got n = {n}")
    check_tokens(tokens, config.vocab)
    written = cache.check_room(t)
    window = attention_window(written, t, cache.capacity, minimum=t)
    tokens, counts = jnp.asarray(tokens, jnp.int32), jnp.asarray(counts)
    native = uses_native(weights, native)
    return _extend_jit(weights, cache, tokens, counts, config=config, native=native, window=window)


def decode_step(
    weights: Weights,
    cache: KVCache,
    tokens: Int[ArrayLike, " B"],
    config: LlamaConfig,
    native: bool | None = None,
) -> tuple[Float[Array, "B V"], KVCache]:
    """One new token per sequence at slot cache.length: its logits and the cache grown by one. native: the native
    kernels (see `uses_native`). Compiled once per (B, capacity, window bucket); the cache is donated (updated in
    place; do not reuse the one passed in)."""
    tokens = np.asarray(tokens)
    check_tokens(tokens, config.vocab)
    window = attention_window(cache.check_room(1), 1, cache.capacity)
    native = uses_native(weights, native)
    return _decode_jit(weights, cache, jnp.asarray(tokens, jnp.int32), config=config, native=native, window=window)


@persistent_jit(**EXTEND_JIT)
def _decode_jit(weights, cache, tokens, config, native, window):
    return extend_unchecked(weights, cache, tokens[:, None], jnp.ones(tokens.shape, jnp.int32), config, native, window)


def uses_native(weights: Weights, native: bool | None) -> bool:
    """Whether to run the native kernels: as asked, else (None) where they can run ($LLAMA_JAX_NATIVE, see
    `kernels`) and the weights lie whole on one device (the kernels read whole arrays, not shards)."""
    if native is not None:
        return native
    sharding = getattr(weights.lnf, "sharding", None)
    return kernels.status().active and (sharding is None or len(sharding.device_set) == 1)
