"""The server's prompt cache: the prompts it has prefilled, kept so that a request whose prompt begins with one of
them (a chat re-sending its history, a shared system prompt) takes those positions' keys and values instead of
computing them again (`decode_batch.prefill_after`), with the same bits as a fresh prefill.

Kept: each admitted prompt's prefill (its cache of its length bucket and its logits), in least-recently-used order
within a limit of bytes; a prompt that begins with a kept one replaces it (any prompt shares at least as much with
the longer one). Only prefilled positions are kept, never decoded ones: a decode step computes a position's keys
with other products than a prefill's block, so a generated answer's positions are computed again in the next
turn's block. Hits, misses and the positions reused are counted for /health.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from llama_jax.core.buckets import MIN_BUCKET
from llama_jax.passes.decode_batch import Prefilled

DEFAULT_BYTES = 1 << 30  # `llama-jax serve`'s default --prompt-cache-mb: 1024
LEAST_REUSED = MIN_BUCKET  # shared positions worth a reuse: fewer cost a copy for less than a bucket's block


class PromptCache:
    """Prefilled prompts by their ids, at most `limit` bytes of keys, values and logits (0: none kept)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.entries: collections.OrderedDict[tuple[int, ...], Prefilled] = collections.OrderedDict()
        self.bytes = 0
        self.hits = self.misses = self.reused = 0

    def longest(self, ids: Sequence[int]) -> tuple[Prefilled, int] | None:
        """The kept prompt that shares the longest beginning with ids, and how many positions it gives them (at
        least LEAST_REUSED; all of them only where it is ids itself, whose logits it holds too; else at most all but
        the last, whose logits the new prefill computes); None where none shares that many."""
        best, shared = None, 0
        ids = np.asarray(ids, np.int64)
        for key, held in self.entries.items():
            common = _common(held.ids, ids)
            if common > shared:
                best, shared = key, common
        exact = best is not None and shared == len(ids) == self.entries[best].length
        shared = shared if exact else min(shared, len(ids) - 1)
        if best is None or shared < LEAST_REUSED:
            return None
        self.entries.move_to_end(best)
        return self.entries[best], shared

    def record(self, reused: int) -> None:
        """Counts a prompt prefilled with `reused` positions taken from a kept one (0: a miss)."""
        self.hits += reused > 0
        self.misses += reused == 0
        self.reused += reused

    def keep(self, prefilled: Prefilled) -> None:
        """Keeps a prompt's prefill (most recently used), dropping the kept prompts it begins with, then the least
        recently used ones past the limit; one larger than the limit is not kept."""
        size = _size(prefilled)
        if size > self.limit:
            return
        key = tuple(prefilled.ids.tolist())
        for other in [k for k in self.entries if len(k) <= len(key) and key[: len(k)] == k]:
            self.bytes -= _size(self.entries.pop(other))
        self.entries[key] = prefilled
        self.bytes += size
        while self.bytes > self.limit:
            _, dropped = self.entries.popitem(last=False)
            self.bytes -= _size(dropped)

    def clear(self) -> None:
        """Drops every kept prompt (the counts stay)."""
        self.entries.clear()
        self.bytes = 0

    def stats(self) -> dict[str, int]:
        """What /health shows."""
        return {
            "entries": len(self.entries),
            "bytes": self.bytes,
            "limit_bytes": self.limit,
            "hits": self.hits,
            "misses": self.misses,
            "positions_reused": self.reused,
        }


def _common(a: np.ndarray, b: np.ndarray) -> int:
    """The length of the longest common beginning of two id arrays."""
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if differ.size else m


def _size(prefilled: Prefilled) -> int:
    return prefilled.cache.k.nbytes + prefilled.cache.v.nbytes + prefilled.logits.nbytes
