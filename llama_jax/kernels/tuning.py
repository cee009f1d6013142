"""The native kernels' speed parameters, chosen for the CPU that runs them. Each is a choice that changes how fast a
result comes, never its bits: which outputs a tile computes side by side, how rows are cut between threads, what
is asked for from memory ahead (matvec.cc's contract fixes every output's order of operations whatever they are;
tests/test_tuning.py checks two sets against each other). They reach the kernels as attributes of each call, so a
compiled program carries the set it was traced with.

The two parameters that measured differently between CPUs follow properties the machine reports, the sizes of its
L1 data cache and its L2 (`choose` gives the figures); the others were measured on a Zen 5 and checked on a Zen 4
and a Zen 3, where no alternative measured better. `benchmarks/tune.py` measures a CPU's matvec candidates side by
side in one process, which is how a CPU that needs other values shows it (then: a row per microarchitecture
here). A short measurement at first use was not taken: on the 2-core virtual machines this project runs on,
memory-bound timings swing by 20% or more between runs of the same code, so it would choose by noise.
`llama-jax info` shows the choice and why.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import numpy as np

from llama_jax.runtime.cpu import l1_data_bytes, l2_bytes


class MatvecTuning(NamedTuple):
    """A matrix-vector product's (matvec.cc's Tuning): split_bytes, the size of 5-8 sequences' x above which the rows
    are read in two passes of 4 sequences (a block widened twice, 4 rows a tile) instead of one of 8 (1 row a tile),
    or (blocks, AVX2) the inputs in segments whose x is within it; ahead_small and ahead_large, the bytes of a block
    row asked for ahead of where it is read, in matrices under and over 2 MB; items_per_thread, how many pieces the
    rows are cut into per thread."""

    split_bytes: int
    ahead_small: int = 4096
    ahead_large: int = 16384
    items_per_thread: int = 4

    def attributes(self) -> dict[str, np.int64]:
        """The FFI call's attributes."""
        return {name: np.int64(value) for name, value in self._asdict().items()}

    def __str__(self) -> str:
        return ", ".join(f"{name} {value}" for name, value in self._asdict().items())


class ProductTuning(NamedTuple):
    """A block product's (products.cc's RunProduct): large_x_bytes, the size of a row block's x past which its
    columns go in as few items as keep every thread busy (x then streams from L3 or memory a few times, not once
    per group of 8 panels)."""

    large_x_bytes: int

    def attributes(self) -> dict[str, np.int64]:
        """The FFI call's attributes."""
        return {"large_x": np.int64(self.large_x_bytes)}

    def __str__(self) -> str:
        return f"large_x_bytes {self.large_x_bytes}"


@dataclasses.dataclass(frozen=True)
class Choice:
    """The parameters this machine's kernels run with, and why."""

    matvec: MatvecTuning
    product: ProductTuning
    reason: str

    def __str__(self) -> str:
        return f"matvec {self.matvec}; product {self.product} ({self.reason})"


def choose(l1_bytes: int | None, l2: int | None = None) -> Choice:
    """The parameters for a CPU whose L1 data cache holds l1_bytes and whose L2 holds l2 (None: not known, taken
    as 32 KB and 1 MB).

    split_bytes is the L1's size. Measured (batch 8 of Q4_1 rows streaming from memory, benchmarks/tune.py): on a Zen 4
    (32 KB) two passes take 116 µs where one takes 169 for 1536 inputs (x 48 KB), and 129 against 116 for 576 (x 18
    KB); 6 sequences of 1536 (37 KB) are even, 5 (31 KB) favour one pass; its head (576 inputs) 5.0 ms in two passes
    against 3.8 in one. On a Zen 5 (48 KB) two passes paid past its L1 and cost 2-8% inside it. On a Zen 3 (32 KB,
    AVX2: matvec.cc's passes over the item's rows) 1536 inputs, 8 sequences: Q4_1 210 µs against 329, f32 257
    against 404; at 6 (36 KB) Q4_1 187 against 156 but f32, bf16 and Q8_0 6-20% faster in two; 1024 inputs at 8 (32
    KB) even; then, with a matrix of blocks in segments of the inputs instead of two passes (each block widened
    once), 1536 inputs at 8: Q4_1 195 -> 155 µs, Q5_1 323 -> 203, Q8_0 182 -> 166. The aheads and items_per_thread
    are Zen 5's measured values (issue 18); on the Zen 4 and the Zen 3 the alternatives (aheads of 1-64 KB, 1-16
    items a thread) measured within their run-to-run noise, and no ahead at all 10-50% slower.

    large_x_bytes is 16 times the L2. Measured (Q4_1 products, 8 MB against 32 MB in one process, the minimum of
    11 interleaved rounds): on a Zen 3 (L2 512 KB) 8000 rows of 576 inputs (x 18 MB) 41.2 -> 34.1 ms for 576
    columns (medians 50.1 -> 43.4), 126 -> 117 ms for 1536 (medians even), 2048 rows of 1536 inputs (12.6 MB) even;
    on a Zen 4 (1 MB) 8 MB made those 2048-row products 5-10% slower in 2 of 3 rounds (interleaved builds), and
    past 32 MB the wide items gave the head's transposed product and 8000 rows' down projection 10-20%."""
    l1, l2_known = l1_bytes or 32768, l2 or (1 << 20)
    known = "its L1 data cache" if l1_bytes else "an L1 data cache of unknown size, taken as"
    known_l2 = "its L2" if l2 else "an L2 of unknown size, taken as"
    reason = (
        f"5-8 sequences in two passes past {known} {l1 >> 10} KB; a product's wide items past 16 x {known_l2} "
        f"{l2_known >> 10} KB"
    )
    return Choice(MatvecTuning(split_bytes=l1), ProductTuning(large_x_bytes=16 * l2_known), reason)


@functools.cache
def chosen() -> Choice:
    """This machine's choice, made once per process."""
    return choose(l1_data_bytes(), l2_bytes())
