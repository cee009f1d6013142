"""Length buckets and padded blocks: a block of T tokens is padded to the next power of two (at least 16), so a
run over prompts of many lengths compiles a handful of times, not once per length (a scored block, whose padding
is all computed, to a finer `score_length`); the sequences of a batch sit
at the start of their rows (right padding, which causal attention from position 0 never reads)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MIN_BUCKET = 16


def bucket(n: int, cap: int | None = None) -> int:
    """The smallest power of two ≥ max(n, MIN_BUCKET), but no more than cap (which must be ≥ n)."""
    size = max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())
    return size if cap is None else min(size, cap)


def score_length(n: int, cap: int | None = None) -> int:
    """A scored block's length for sequences of up to n tokens: n itself from 4 to 16, above that n rounded up to a
    multiple of a sixteenth of its power of two (eight lengths an octave: 18, 20, ..., 32, 36, ..., 64, 72, ...),
    but no more than cap. Finer than `bucket`'s powers of two because scoring computes every padded position:
    lm-eval's multiple-choice inputs of 4-15 tokens computed 1.37x their tokens in multiples of 8 (1.45x all padded
    to 16), 1.16x in multiples of 4, 1.02x so. The price is more compiled shapes (under a second each)."""
    power = 1 << max(n - 1, 0).bit_length()
    step = max(1, power // 16)
    size = max(4, -(-n // step) * step)
    return size if cap is None else min(size, cap)


def padded_block(sequences: Sequence[Sequence[int] | np.ndarray], length: int, rows: int | None = None) -> np.ndarray:
    """The sequences as the rows of an int32 [B, T] block (B: rows, default one per sequence; T: length), each
    from column 0, the rest 0 (padding); the caller has checked that each fits."""
    block = np.zeros((len(sequences) if rows is None else rows, length), dtype=np.int32)  # [B, T]
    for b, ids in enumerate(sequences):
        block[b, : len(ids)] = ids
    return block
