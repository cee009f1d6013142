"""The spec's sampler ("Sampling" in main.bend) in plain Python and numpy float32 scalars, written from the spec
alone and kept independent of llama_jax: the tests compare the package's draws with these."""

from __future__ import annotations

import numpy as np

F = np.float32
MASK = 0xFFFFFFFF


def hash32(x: int) -> int:
    """lowbias32 on Python ints, wrapping at 2^32 by masking."""
    x &= MASK
    x ^= x >> 16
    x = (x * 2146121005) & MASK
    x ^= x >> 15
    x = (x * 2221713035) & MASK
    return x ^ (x >> 16)


def hash32_array(x: np.ndarray) -> np.ndarray:
    """The same on a uint64 array holding uint32 values (products masked back to 32 bits)."""
    x = x.astype(np.uint64) & MASK
    x ^= x >> 16
    x = (x * 2146121005) & MASK
    x ^= x >> 15
    x = (x * 2221713035) & MASK
    return x ^ (x >> 16)


def uniform_bits(seeds: np.ndarray, ns: np.ndarray) -> np.ndarray:
    """The float32 bit patterns of uniform(seed, n): top 24 bits of hash32(hash32(seed) + n), times 2^-24."""
    top = hash32_array((hash32_array(seeds) + ns.astype(np.uint64)) & MASK) >> 8
    return (top.astype(np.float32) * F(2.0**-24)).view(np.uint32)


def uniform(seed: int, n: int) -> np.float32:
    return F(F(hash32((hash32(seed) + n) & MASK) >> 8) * F(2.0**-24))


def argmax(xs: np.ndarray) -> int:
    best = 0
    for i in range(1, len(xs)):
        if xs[i] > xs[best]:
            best = i
    return best


def sample(xs: np.ndarray, temperature: float, top_k: int | None, top_p: float, u: np.float32) -> int:
    """The spec's `sample`, step by step; temperature 0 is argmax."""
    xs = np.asarray(xs, dtype=np.float32)
    if temperature == 0:
        return argmax(xs)
    k = len(xs) if not top_k or top_k > len(xs) else top_k
    # the k largest, ties: the lower id first (a stable sort; -0.0 and 0.0 compare equal, as F32 comparison says)
    candidates = sorted(range(len(xs)), key=lambda i: -xs[i])[:k]
    t = F(temperature)
    top = xs[candidates[0]]

    def weight(v: np.float32) -> np.float32:
        return np.exp(F(F(v / t) - F(top / t)))

    z = F(0)
    for c in candidates:
        z = F(z + weight(xs[c]))
    limit = F(F(top_p) * z)
    kept, acc = 0, F(0)
    for c in candidates:  # each kept while the weight before it is below p·Z; the first always
        if kept > 0 and not acc < limit:
            break
        acc = F(acc + weight(xs[c]))
        kept += 1
    target = F(F(u) * acc)
    acc = F(0)
    for j, c in enumerate(candidates[:kept]):
        after = F(acc + weight(xs[c]))
        if j == kept - 1 or target < after:
            return c
        acc = after
    raise AssertionError("unreachable: the last kept candidate always stops the draw")
