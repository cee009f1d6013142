"""Batch scoring: the log-probability of every scored token of many sequences, for likelihoods, perplexity and
multiple-choice evaluation (as lm-evaluation-harness does it).

One jitted forward over a padded [B, T] batch: sequences are sorted by length (little padding), padded at the
end to a length of `score_length` (a run over a data set compiles a handful of times), and the batch is padded to
batch_size rows (one shape per length). Right padding changes nothing for the real positions: attention is
causal and every sequence starts at position 0. Only log-probabilities leave the device, not [B, T, vocab] logits.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable, Iterable, Sequence

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from llama_jax.core.buckets import padded_block, score_length
from llama_jax.core.config import LlamaConfig
from llama_jax.core.sharding import to_host
from llama_jax.core.weights import Weights
from llama_jax.errors import InvalidArgumentError
from llama_jax.nn.head import score_rows
from llama_jax.passes.checks import check_count, check_ids, ids_of
from llama_jax.passes.forward import last_stream
from llama_jax.runtime.executables import persistent_jit

Item = str | Sequence[int] | tuple[str | Sequence[int], str | Sequence[int]]
Encode = Callable[[str], list[int]]  # a text's ids (the tokenizer's encode)
# how score_batch is jitted (the tests count its traces under it)
SCORE_JIT = {"static_argnames": ("config", "with_next", "native")}


@dataclasses.dataclass(frozen=True)
class Score:
    """The scored tokens of one sequence (every token after the first; a pair's continuation): their ids, their
    log-probabilities, the sum, and whether all were the argmax (greedy) at their positions; is_argmax: that, token
    by token. next: with `with_next`, the log-probabilities of every token of the vocabulary after the last one
    (what one forward pass gives every continuation of the sequence by one token), else None."""

    ids: np.ndarray
    logprobs: np.ndarray
    total: float
    greedy: bool
    is_argmax: np.ndarray
    next: np.ndarray | None = None


def perplexity(scores: Iterable[Score]) -> float:
    """exp of minus the mean log-probability over every scored token of every score."""
    scores = list(scores)
    count = sum(s.logprobs.size for s in scores)
    if count == 0:
        raise InvalidArgumentError("perplexity of no scored tokens; give at least one score with a scored token")
    return math.exp(-sum(float(s.logprobs.astype(np.float64).sum()) for s in scores) / count)


@persistent_jit(**SCORE_JIT)
def score_batch(
    weights: Weights,
    tokens: Int[Array, "B T"],
    first: Int[Array, " B"],
    last: Int[Array, " B"],
    config: LlamaConfig,
    with_next: bool = False,
    native: bool = False,
) -> tuple[Float[Array, "B T-1"], Bool[Array, "B T-1"], Float[Array, "B V"] | None]:
    """log p(token t | tokens < t) for t = first[b]..last[b] (0 elsewhere), whether each of those tokens is its
    position's argmax, and with_next (static) the log-probabilities of the vocabulary after each sequence's last
    real token (at index last[b]). native (static): the native kernels (`head.score_rows`: the native head
    computes the scored positions only)."""
    b, t = tokens.shape
    targets = tokens[:, 1:]  # [B, T-1]: position t predicts token t + 1
    index = jnp.arange(1, t, dtype=jnp.int32)[None, :]  # [1, T-1]: the index of each target
    scored = (index >= first[:, None]) & (index <= last[:, None])  # [B, T-1]
    x = last_stream(weights, tokens, config, native, last + 1)  # [B, T, D]
    targets = jnp.where(scored, targets, -1)  # [B, T-1]
    if not with_next:
        chosen, best, _ = score_rows(weights, x[:, :-1], targets, config, native)  # [B, T-1] each
        return jnp.where(scored, chosen, 0.0), scored & (best == targets), None
    # one pass over the head for both: the scored rows and, after them, each last token's row (its whole
    # vocabulary's log-probabilities, in the bits that scoring each one-token continuation gives)
    rows = jnp.concatenate([x[:, :-1], jnp.take_along_axis(x, last[:, None, None], axis=1)], axis=1)  # [B, T, D]
    ends = jnp.arange(b, dtype=jnp.int32) * t + t - 1  # [B]: each last token's row, flattened
    padded = jnp.pad(targets, ((0, 0), (0, 1)))  # [B, T]: a kept row is scored (token 0's, unread)
    chosen, best, after = score_rows(weights, rows, padded, config, native, ends)  # [B, T] each, [B, V]
    return jnp.where(scored, chosen[:, :-1], 0.0), scored & (best[:, :-1] == targets), after


def every_logprob(
    weights: Weights, tokens: Int[Array, "B T"], config: LlamaConfig, native: bool = False
) -> Float[Array, "B T-1 V"]:
    """Each position's log-probabilities of the whole vocabulary for the token after it, in the bits `score_batch`
    gives that token."""
    return logprobs_of_stream(weights, last_stream(weights, tokens, config, native), tokens, config, native)


def logprobs_of_stream(
    weights: Weights, x: Float[Array, "B T D"], tokens: Int[Array, "B T"], config: LlamaConfig, native: bool = False
) -> Float[Array, "B T-1 V"]:
    """`every_logprob` from the last layer's output x (before the final norm) of the tokens, for a pass that has
    run the layers already (a prefill that scores its prompt)."""
    b, t = tokens.shape
    every = jnp.arange(b * (t - 1), dtype=jnp.int32)  # [B·(T-1)]: every row's log-probabilities kept
    _, _, rows = score_rows(weights, x[:, :-1], tokens[:, 1:], config, native, every)  # [B·(T-1), V]
    return rows.reshape(b, t - 1, -1)  # [B, T-1, V]


def prepare(item: Item, encode: Encode, config: LlamaConfig, least: int = 2) -> tuple[np.ndarray, int]:
    """The ids of an item and the index of its first scored token: a text or ids (from 1), or a pair
    (context, continuation) of texts or ids (the continuation's); a text or ids needs at least `least` tokens."""
    if isinstance(item, tuple):
        if len(item) != 2:
            raise InvalidArgumentError(f"a pair to score is (context, continuation), got {len(item)} parts")
        context, continuation = (list(ids_of(part, encode)) for part in item)
        if not context or not continuation:
            raise InvalidArgumentError(
                "a (context, continuation) pair needs tokens in both; the first token is never scored"
            )
        ids, first = context + continuation, len(context)
    else:
        ids, first = list(ids_of(item, encode)), 1
        if len(ids) < least:
            raise InvalidArgumentError(
                f"a sequence to score needs at least {least} tokens (the first is not scored), got {item!r:.80}"
            )
    return check_ids(ids, config, fix="score a shorter one"), first


def score(
    weights: Weights,
    config: LlamaConfig,
    encode: Encode,
    items: Sequence[Item],
    batch_size: int = 8,
    progress: bool | None = None,
    place=None,
    with_next: bool = False,
    native: bool = False,
) -> list[Score]:
    """Every item scored, in the order given; encode gives a text's ids. place: how a [B, T] batch goes onto the
    devices (a function, e.g. `core.sharding.place_batch`), None for the default device. with_next: each Score also
    holds the log-probabilities of the token after its last (then a sequence of one token is scored too: no token,
    only what follows it). native: the native block products (a Model's `native`)."""
    check_count(batch_size, "batch_size")
    prepared = [prepare(item, encode, config, 1 if with_next else 2) for item in items]
    order = sorted(range(len(prepared)), key=lambda i: -prepared[i][0].size)
    results: list[Score | None] = [None] * len(prepared)
    show = sys.stderr.isatty() if progress is None else progress
    from tqdm import tqdm  # here: a progress stack costs start-up time

    for start in tqdm(range(0, len(order), batch_size), desc="scoring", unit="batch", disable=not show):
        rows = order[start : start + batch_size]
        length = score_length(prepared[rows[0]][0].size, config.context)
        block = padded_block([prepared[i][0] for i in rows], length, batch_size)  # [B, T]: rows past the data pad
        first = np.ones(batch_size, dtype=np.int32)  # [B]: each row's first scored token (rows of padding: none)
        last = np.zeros(batch_size, dtype=np.int32)  # [B]: each row's last real token
        first[: len(rows)] = [prepared[i][1] for i in rows]
        last[: len(rows)] = [prepared[i][0].size - 1 for i in rows]
        tokens = jnp.asarray(block) if place is None else place(block)
        out = score_batch(weights, tokens, jnp.asarray(first), jnp.asarray(last), config, with_next, native)
        logprobs, greedy = to_host(out[0]), to_host(out[1])  # [B, T-1] each
        after = None if out[2] is None else to_host(out[2])  # [B, V]
        for r, i in enumerate(rows):
            ids, first = prepared[i]
            lp, gr = logprobs[r, first - 1 : ids.size - 1], greedy[r, first - 1 : ids.size - 1]
            total = float(lp.astype(np.float64).sum())
            results[i] = Score(ids[first:], lp, total, bool(gr.all()), gr, None if after is None else after[r])
    return results
