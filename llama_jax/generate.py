"""Greedy generation: prefill the prompt (padded to a length bucket), then one jitted decode step per new token.

The cache's capacity is the bucket of prompt + new tokens, at least MIN_CAPACITY and at most the model's context,
so the decode step compiles once per capacity bucket, not per prompt, and short generations share one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from llama_jax.buckets import bucket
from llama_jax.cache import KVCache
from llama_jax.config import LlamaConfig
from llama_jax.errors import CapacityError
from llama_jax.passes import check_tokens, decode_step, prefill
from llama_jax.weights import Weights

MIN_CAPACITY = 256


def plan_capacity(prompt_len: int, max_new_tokens: int, config: LlamaConfig) -> int:
    """The cache capacity for a prompt and its new tokens; CapacityError up front if they exceed the context."""
    if prompt_len < 1:
        raise CapacityError("the prompt is empty; generation needs at least one token to start from")
    if max_new_tokens < 0:
        raise CapacityError(f"max_new_tokens must be at least 0, got {max_new_tokens}")
    needed = prompt_len + max_new_tokens
    if needed > config.context:
        raise CapacityError(
            f"a prompt of {prompt_len} tokens plus {max_new_tokens} new tokens needs {needed} positions, past the"
            f" model's context of {config.context}; shorten the prompt or lower max_new_tokens"
        )
    return bucket(max(needed, MIN_CAPACITY), config.context)


def greedy(
    weights: Weights, config: LlamaConfig, ids: Sequence[int], max_new_tokens: int, eos_ids: Sequence[int]
) -> list[int]:
    """The new ids after `ids`, each the argmax of its logits (the lowest id on ties), ending with the first
    end-of-sequence id if one comes before max_new_tokens."""
    ids = np.asarray(ids, dtype=np.int64)
    check_tokens(ids, config.vocab)
    capacity = plan_capacity(len(ids), max_new_tokens, config)
    if max_new_tokens == 0:
        return []
    block = np.zeros((1, bucket(len(ids), capacity)), dtype=np.int32)  # [B=1, T]
    block[0, : len(ids)] = ids
    logits, cache = prefill(weights, KVCache.empty(config, 1, capacity), block, config, n=len(ids))
    new: list[int] = []
    while True:
        token = int(np.argmax(np.asarray(logits[0])))
        new.append(token)
        if token in eos_ids or len(new) == max_new_tokens:
            return new
        logits, cache = decode_step(weights, cache, np.array([token], dtype=np.int32), config)
