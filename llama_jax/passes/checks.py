"""The checks at the passes' boundaries, each written once: on the host before anything runs (counts, token ids,
a text or ids, one sequence within the vocabulary and the model's context, the cache's room), and inside compiled
code as checkify checks (`extend`), whose failure `throw` raises as the package's error.

A write at or past a cache's capacity and an id outside [0, vocab) are refused because `dynamic_update_slice` and
the embedding gather would otherwise clamp them silently (the spec's kv_room law rules that out).
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jaxtyping import ArrayLike, Int

from llama_jax.core.config import LlamaConfig
from llama_jax.core.kv_cache import KVCache
from llama_jax.errors import CapacityError, InvalidArgumentError, LlamaJaxError, TokenIdError

# The in-graph checks' format strings, and the error each one's failure raises (see `throw`).
ROOM_CHECK = (
    "KV cache full: writing {n} position(s) after the {length} already written is past the capacity {cap};"
    " make a cache with a larger capacity"
)
WINDOW_CHECK = "attention window {w} is shorter than the positions written; attend to at least max(length) + T slots"
TOKEN_CHECK = "token id {id} is outside the vocabulary [0, {vocab})"
_CHECKS: dict[str, type[LlamaJaxError]] = {
    ROOM_CHECK: CapacityError,
    WINDOW_CHECK: CapacityError,
    TOKEN_CHECK: TokenIdError,
}


# ---- on the host ----


def check_count(value: object, name: str, least: int = 1) -> None:
    """InvalidArgumentError unless value is an int ≥ least (a bool is not a count): a batch size, a token count."""
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        wanted = "a positive integer" if least == 1 else f"an integer ≥ {least}"
        raise InvalidArgumentError(f"{name} must be {wanted}, got {value!r}")


def check_tokens(tokens: np.ndarray, vocab: int, where: str = "") -> None:
    """Raises TokenIdError naming the first id outside [0, vocab) (host-side, before any compute). where: what
    holds them, as the message's start ("input 3: ")."""
    tokens = np.asarray(tokens)
    if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
        raise InvalidArgumentError(f"{where}token ids must be integers, got an array of {tokens.dtype}")
    bad = (tokens < 0) | (tokens >= vocab)
    if bad.any():
        raise TokenIdError(
            f"{where}token id {int(tokens[bad][0])} is outside the vocabulary [0, {vocab}); ids must lie in"
            f" 0..{vocab - 1}"
        )


def check_ids(ids: object, config: LlamaConfig, where: str = "", fix: str = "give a shorter sequence") -> np.ndarray:
    """One sequence of ids a pass runs from position 0, as a 1-D array, checked against the model: non-empty,
    1-D, integers inside [0, vocab) (TokenIdError) and at most its context (CapacityError). The one check of a
    given sequence (logits, activations, scoring, patching, collecting, gradients). where: what the sequence is,
    as each message's start ("input 3: "); fix: what to do about a sequence longer than the context."""
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.size == 0:
        raise InvalidArgumentError(f"{where}expected a non-empty 1-D sequence of token ids, got shape {ids.shape}")
    check_tokens(ids, config.vocab, where)
    check_context(ids.size, config.context, f"{where}{ids.size} tokens exceed", fix)
    return ids


def ids_of(item: object, encode: Callable[[str], list[int]], where: str = "") -> list[int] | np.ndarray:
    """A text's ids (encode: the tokenizer's), or a sequence of ids as given (checked later, by `check_ids`): the
    one place a text-or-ids argument is told apart."""
    if isinstance(item, str):
        return encode(item)
    if isinstance(item, (list, tuple, np.ndarray)):
        return item
    raise InvalidArgumentError(f"{where}a text or a sequence of token ids, got {type(item).__name__}")


def check_context(positions: int, context: int, what: str, fix: str) -> None:
    """CapacityError unless `positions` fit the model's context (the positions RoPE was trained for, and the
    largest cache a pass makes). what: the sentence's start, saying what needs them; fix: what to do instead."""
    if positions > context:
        raise CapacityError(f"{what} the model's context of {context} positions; {fix}")


def check_room(cache: KVCache, n: int) -> int:
    """Raises CapacityError, before anything is written, unless n more slots fit after every sequence's positions
    (a ring always has room: it holds the window); returns the longest sequence's length."""
    length = int(jnp.max(cache.length))
    room = cache.room(length)  # on the host: no eager op compiled for it
    if room is not None and n > room:
        raise CapacityError(
            f"KV cache full: writing {n} position(s) after the {length} already written needs"
            f" {length + n} slots, but the capacity is {cache.capacity}; make a cache with a larger capacity"
        )
    return length


# ---- inside compiled code (checkify) ----


def check_room_traced(cache: KVCache, n: int) -> None:
    """`check_room` inside jitted code, as a checkify check (the caller wraps the function in checkify)."""
    longest = jnp.max(cache.length)
    checkify.check(cache.fits(n), ROOM_CHECK, n=jnp.int32(n), length=longest, cap=jnp.int32(cache.capacity))


def check_window_traced(cache: KVCache, n: int, window: int) -> None:
    """That the attention window holds every position written once n more are: a checkify check."""
    checkify.check(cache.fits(n, window), WINDOW_CHECK, w=jnp.int32(window))


def check_tokens_traced(tokens: Int[ArrayLike, "*B"], vocab: int) -> None:
    """`check_tokens` inside jitted code, as a checkify check."""
    bad = (tokens < 0) | (tokens >= vocab)
    checkify.check(
        ~jnp.any(bad),
        TOKEN_CHECK,
        id=jnp.where(jnp.any(bad), tokens.ravel()[jnp.argmax(bad.ravel())], 0),
        vocab=jnp.int32(vocab),
    )


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
