"""Length buckets: a block of T tokens is padded to the next power of two (at least 16), so a run over prompts of
many lengths compiles a handful of times, not once per length."""

from __future__ import annotations

MIN_BUCKET = 16


def bucket(n: int, cap: int | None = None) -> int:
    """The smallest power of two ≥ max(n, MIN_BUCKET), but no more than cap (which must be ≥ n)."""
    size = max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())
    return size if cap is None else min(size, cap)
