"""The sampler draws what the spec's sampler draws, bit for bit: the package (eager and jitted-batched) against
an independent reference written from the spec (tests/reference_sampler.py) and the spec's worked examples."""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax import SamplingError
from llama_jax import sampling as S
from tests import reference_sampler as R
from tests.helpers import suite_cache

# the spec's worked examples (a copy of shared/reference/sampler_examples.json)
EXAMPLES = Path(__file__).resolve().parent / "data" / "sampler_examples.json"


@pytest.fixture(scope="module")
def examples():
    return json.loads(EXAMPLES.read_text())


def test_hash32_and_uniform_equal_the_spec_examples(examples):
    for h in examples["hash32"]:
        assert int(S.hash32(h["x"])) == h["hash32"] == R.hash32(h["x"])
    for c in examples["cases"]:
        assert int(np.asarray(S.uniform(c["seed"], c["n"])).view(np.uint32)) == c["u_bits"]


def test_sample_and_argmax_equal_the_spec_examples(examples):
    for c in examples["cases"]:
        logits = np.array(c["logits"], np.float32)
        u = float(S.uniform(c["seed"], c["n"]))
        assert S.sample(logits, c["temperature"], c["top_k"], c["top_p"], u) == c["id"]
        assert S.sample(logits, 0.0, None, 1.0, 0.0) == c["argmax"]


@pytest.mark.parametrize("vocab", [1, 5, 128, 300, 49152])
def test_greedy_argmax_is_the_first_index_of_each_row_s_maximum(vocab):
    """argmax_batch (in blocks) equals jnp.argmax on rows of random logits, ties (the first index), a NaN (the first
    NaN), +inf, rows all -inf, for vocabularies under, at and past a multiple of the block."""
    from llama_jax.passes.sampling import argmax_batch

    rng = np.random.default_rng(vocab)
    rows = rng.integers(-3, 3, size=(8, vocab)).astype(np.float32)  # many ties
    rows[1] = rng.standard_normal(vocab)
    rows[2, rng.integers(vocab, size=2)] = np.nan
    rows[3, rng.integers(vocab)] = np.inf
    rows[4] = -np.inf
    rows[5, -1] = 10.0  # the last logit, in the last (padded) block
    got = np.asarray(jax.jit(argmax_batch)(jnp.asarray(rows)))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(rows), axis=-1)))


def test_uniform_agrees_bit_for_bit_on_a_million_pairs():
    """1,000,000 (seed, n) pairs, seeds anywhere in [0, 2^32) and near 2^32 (where hash32(seed) + n wraps)."""
    rng = np.random.default_rng(0)
    seeds = rng.integers(0, 2**32, 1_000_000, dtype=np.uint64)
    seeds[:200_000] = 2**32 - 1 - rng.integers(0, 1000, 200_000, dtype=np.uint64)
    ns = rng.integers(0, 2**32, 1_000_000, dtype=np.uint64)
    ns[:500_000] = rng.integers(0, 4096, 500_000, dtype=np.uint64)
    mine = np.asarray(S.uniform(jnp.asarray(seeds.astype(np.uint32)), jnp.asarray(ns.astype(np.uint32))))
    np.testing.assert_array_equal(mine.view(np.uint32), R.uniform_bits(seeds, ns))
    assert mine.min() >= 0 and mine.max() < 1


def random_case(rng: np.random.Generator, vocab: int) -> dict:
    """Logits with exact ties, signed zeros, wide and narrow spreads; every kind of k, p and temperature."""
    kind = rng.integers(0, 4)
    if kind == 0:
        logits = rng.standard_normal(vocab) * rng.choice([0.1, 1.0, 5.0, 30.0])
    elif kind == 1:
        logits = rng.integers(-4, 5, vocab).astype(np.float64)  # many exact ties
    elif kind == 2:
        logits = np.round(rng.standard_normal(vocab) * 4, 1)
        logits[rng.random(vocab) < 0.3] = -0.0
    else:
        logits = rng.choice(rng.standard_normal(max(1, vocab // 8)) * 10, vocab)  # repeated values
    k = rng.choice([None, 0, 1, 2, int(rng.integers(1, vocab + 1)), vocab, vocab + 3])
    p = float(rng.choice([1e-6, 0.01, 0.3, 0.5, 0.9, 0.95, 0.999, 1.0, rng.random() or 1.0]))
    temperature = float(rng.choice([0.0, 0.05, 0.25, 0.7, 1.0, 1.3, 2.0, 10.0]))
    seed = int(rng.choice([rng.integers(0, 2**32), 2**32 - 1 - rng.integers(0, 5)]))
    return {
        "logits": logits.astype(np.float32),
        "temperature": temperature,
        "top_k": None if k is None else int(k),
        "top_p": p,
        "seed": seed,
        "n": int(rng.integers(0, 10_000)),
    }


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    """20,000 random cases (60 over SmolLM2's full 49,152-token vocabulary) with the reference's draw. The
    reference, in plain Python, takes about 15 s over them: its draws are kept in the tests' cache under a hash of
    this file, the reference's and numpy's version (what makes the cases and the draws), and read back after."""
    rng = np.random.default_rng(1)
    vocabs = [1, 2, 3, 5, 8, 16, 64, 257, 1000, 4096]
    out = [random_case(rng, int(rng.choice(vocabs))) for _ in range(19_940)]
    out += [random_case(rng, 49_152) for _ in range(60)]
    sources = Path(R.__file__).read_bytes() + Path(__file__).read_bytes() + np.__version__.encode()
    path = suite_cache() / "sampler" / f"{hashlib.sha256(sources).hexdigest()[:32]}.npy"
    if path.is_file():
        ids = np.load(path).tolist()
    else:
        ids = [R.sample(c["logits"], c["temperature"], c["top_k"], c["top_p"], R.uniform(c["seed"], c["n"]))
               for c in out]  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npy", delete=False) as f:
            np.save(f, np.asarray(ids, np.int64))
        Path(f.name).replace(path)  # whole or not at all
    assert len(ids) == len(out)
    for c, i in zip(out, ids, strict=True):
        c["id"] = i
    return out


def _batched(rows: list[dict], width: int) -> list[int]:
    ids = S.sample_batch(
        jnp.asarray(np.stack([c["logits"] for c in rows])),
        jnp.asarray([c["temperature"] for c in rows], jnp.float32),
        jnp.asarray([c["top_k"] or 0 for c in rows], jnp.int32),
        jnp.asarray([c["top_p"] for c in rows], jnp.float32),
        jnp.asarray([c["seed"] for c in rows], jnp.uint32),
        jnp.asarray([c["n"] for c in rows], jnp.int32),
        width=width,
    )
    return np.asarray(ids).tolist()


@pytest.mark.slow
def test_jitted_batched_sampler_equals_the_reference_on_20000_cases(cases):
    """Rows of a vocabulary size drawn together, all ids sorted (width = vocab)."""
    groups = defaultdict(list)
    for c in cases:
        groups[c["logits"].size].append(c)
    for vocab, rows in groups.items():
        size = min(512, len(rows))  # one shape a vocabulary: the last chunk is padded with copies of its first row
        for start in range(0, len(rows), size):
            chunk = rows[start : start + size]
            padded = chunk + [chunk[0]] * (size - len(chunk))
            assert _batched(padded, vocab)[: len(chunk)] == [c["id"] for c in chunk], f"vocab {vocab}"


@pytest.mark.slow
def test_batched_sampler_with_top_k_width_equals_the_reference(cases):
    """Rows that all have a top_k sort only that many candidates (the generation path with top_k set)."""
    rows = [c for c in cases if c["top_k"] and c["top_k"] < c["logits"].size and c["logits"].size == 1000][:400]
    assert len(rows) > 100
    assert _batched(rows, max(c["top_k"] for c in rows)) == [c["id"] for c in rows]


def test_eager_sample_equals_the_reference(cases):
    for c in cases[:3000]:
        u = float(S.uniform(c["seed"], c["n"]))
        assert S.sample(c["logits"], c["temperature"], c["top_k"], c["top_p"], u) == c["id"]


def test_fixed_case_gives_the_ids_computed_once_by_the_reference():
    """Draws n = 0..15 of seed 1234 from fixed logits (ties, ±0) at temperature 0.8, top-k 6, top-p 0.9."""
    logits = np.array([2.5, -1.0, 2.5, 0.0, -0.0, 1.25, 3.0, -2.0, 1.25, 0.5, 2.0, -0.5], np.float32)
    ids = [S.sample(logits, 0.8, 6, 0.9, float(S.uniform(1234, n))) for n in range(16)]
    assert ids == [0, 6, 0, 6, 0, 6, 2, 0, 6, 2, 2, 6, 10, 0, 2, 2]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((np.zeros(4), -0.5, None, 1.0, 0.5), "temperature"),
        ((np.zeros(4), float("nan"), None, 1.0, 0.5), "temperature"),
        ((np.zeros(4), 1.0, -1, 1.0, 0.5), "top_k"),
        ((np.zeros(4), 1.0, 2.5, 1.0, 0.5), "top_k"),
        ((np.zeros(4), 1.0, None, 0.0, 0.5), "top_p"),
        ((np.zeros(4), 1.0, None, 1.5, 0.5), "top_p"),
        ((np.array([0.0, np.nan, 1.0]), 1.0, None, 1.0, 0.5), r"finite; found nan at index \(1,\)"),
        ((np.array([0.0, np.inf]), 1.0, None, 1.0, 0.5), "finite"),
        ((np.zeros(4), 1.0, None, 1.0, 1.0), "u must lie"),
        ((np.zeros((2, 3)), 1.0, None, 1.0, 0.5), "one row"),
        ((np.zeros(0), 1.0, None, 1.0, 0.5), "empty"),
    ],
)
def test_bad_values_raise_sampling_error(args, match):
    with pytest.raises(SamplingError, match=match):
        S.sample(*args)


def test_one_seed_gives_sequence_b_seed_plus_b_and_one_past_2_32_is_refused_never_wrapped():
    """One seed for a batch gives sequence b the seed + b, each a seed in [0, 2^32): the last seeds are taken, and a
    batch that would need one past them is refused, naming the largest seed it may have (wrapped to 0, a sequence
    would silently repeat seed 0's draws); so are a seed that is not one and a list holding one."""
    assert S.Sampling(seed=2**32 - 3).seeds(3).tolist() == [2**32 - 3, 2**32 - 2, 2**32 - 1]
    past = r"the 3 sequences sample with seed \+ j \(sequence j\), and seed 4294967294 \+ 2 = 4294967296"
    with pytest.raises(SamplingError, match=past + r" is past 2\^32 - 1 .*: give a seed of at most 4294967293"):
        S.Sampling(seed=2**32 - 2).seeds(3)
    for seed in (-1, True, 2**32, [0, 2**32]):
        with pytest.raises(SamplingError, match=r"is not an integer in \[0, 2\^32\)"):
            S.Sampling(seed=seed).seeds(1 if isinstance(seed, int) else 2)
