"""Generation: prefill the prompts (a batch, each padded to the length bucket), then the new tokens in chunks of
CHUNK, each chunk one jitted loop on the device (`decode_batch`).

Prompts of different lengths share the batch: each sits at its own positions from 0 (right padding, masked), so
a sequence gets in a batch the tokens it gets alone. The cache's capacity is the bucket of the longest prompt +
new tokens, at least MIN_CAPACITY and at most the model's context, so the decode step compiles once per
(batch, capacity bucket), not per prompt. Draws follow the spec's sampler (`sampling`): new token i of sequence b
uses uniform(seeds[b], i).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from jax.sharding import Mesh

from llama_jax.core.buckets import bucket
from llama_jax.core.config import LlamaConfig
from llama_jax.core.weights import Weights
from llama_jax.errors import GrammarError, InvalidArgumentError
from llama_jax.passes.checks import check_context, check_count, check_tokens
from llama_jax.passes.decode_batch import CHUNK, DecodeBatch, RowSettings
from llama_jax.passes.sampling import Sampling
from llama_jax.text.grammar import Guide

MIN_CAPACITY = 256


def plan_capacity(prompt_len: int, max_new_tokens: int, config: LlamaConfig) -> int:
    """The cache capacity for a prompt and its new tokens; CapacityError up front if they exceed the context."""
    if prompt_len < 1:
        raise InvalidArgumentError("the prompt is empty; generation needs at least one token to start from")
    check_count(max_new_tokens, "max_new_tokens", least=0)
    needed = prompt_len + max_new_tokens
    what = f"a prompt of {prompt_len} tokens plus {max_new_tokens} new tokens needs {needed} positions, past"
    check_context(needed, config.context, what, "shorten the prompt or lower max_new_tokens")
    whole_chunks = prompt_len + -(-max_new_tokens // CHUNK) * CHUNK  # the last chunk may run past the last token
    return bucket(max(whole_chunks, MIN_CAPACITY), config.context)


def token_steps(
    weights: Weights,
    config: LlamaConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    mesh: Mesh | None = None,
    native: bool = False,
    guides: Sequence[Guide] | None = None,
) -> Iterator[np.ndarray]:
    """The new ids of every sequence [B], one step at a time, max_new_tokens steps unless the caller stops
    early (sampling.stop is the caller's: it sees the text). Everything is checked before the first step: ids,
    capacity, settings, seeds. mesh: the cache is split over it like the (sharded) weights. native: decode with
    the native kernels (a Model's `native.active`, never for sharded weights). guides: each sequence's grammar's
    (`text.grammar.Guide`, made from sampling.grammar); GrammarError where one fails."""
    prompts = [np.asarray(p, dtype=np.int64) for p in prompts]
    if sampling is not None and sampling.grammar is not None and guides is None:
        raise InvalidArgumentError("a grammar needs each sequence's guide (Model.guide(grammar)); none was given")
    if not prompts:
        raise InvalidArgumentError("no prompts to generate from; give at least one prompt")
    for p in prompts:
        check_tokens(p, config.vocab)
    lengths = [p.size for p in prompts]
    capacity = plan_capacity(max(lengths), max_new_tokens, config)
    if min(lengths) < 1:
        raise InvalidArgumentError("a prompt is empty; generation needs at least one token to start from")
    sampling = Sampling() if sampling is None else sampling  # greedy
    settings = RowSettings.of(sampling, sampling.seeds(len(prompts)), config.vocab)
    if max_new_tokens == 0:
        return
    batch = DecodeBatch.prefill(weights, config, prompts, capacity, settings, native, mesh, guides)
    done = 0
    while done < max_new_tokens:
        batch, tokens, _ = batch.advance(weights, config, native)  # [B, T]
        failed = [g.error for g in guides or () if g.error]
        if failed:
            raise GrammarError(f"constrained decoding failed: {failed[0]}")
        yield from tokens.T[: max_new_tokens - done]
        done += tokens.shape[1]
