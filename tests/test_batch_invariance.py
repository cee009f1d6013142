"""A sequence gets the same bits alone and inside any batch (sizes 1 to 16, mixed prompt lengths, any place in
the batch): the prefill's logits, the decode steps' logits and tokens, and the scored log-probabilities, on the
native path and on XLA's (see `nn.invariant`, matvec.cc). One exception, measured and stated in docs/numerics.md:
XLA's decode step at batch 1 against batch ≥ 2 (XLA evaluates exp with a code path chosen by the array's size)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llama_jax import KVCache, kernels, prefill
from llama_jax.core.buckets import bucket
from llama_jax.passes.decode_batch import RowSettings, decode_chunk

pytestmark = pytest.mark.slow
STEPS = 3


def _run(model, prompts, native):
    """Prefill logits [B, V], STEPS greedy tokens [B, STEPS] and the logits after them [B, V]."""
    c, b = model.config, len(prompts)
    lengths = [len(p) for p in prompts]
    block = np.zeros((b, bucket(max(lengths))), np.int32)
    for i, p in enumerate(prompts):
        block[i, : len(p)] = p
    logits, cache = prefill(model.weights, KVCache.empty(c, b, 256), block, c, n=lengths, native=native)
    first = np.asarray(logits)
    settings = RowSettings(jnp.zeros(b), jnp.zeros(b, jnp.int32), jnp.ones(b), jnp.zeros(b, jnp.uint32))
    out, logits, _, _ = decode_chunk(
        model.weights, cache, logits, settings, jnp.zeros(b, jnp.int32),
        config=c, steps=STEPS, width=1, greedy=True, native=native, window=256,
    )  # fmt: skip
    return first, np.asarray(out), np.asarray(logits)


prompt = st.lists(st.integers(0, 49151), min_size=2, max_size=70)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(target=prompt, others=st.lists(prompt, min_size=1, max_size=15), place=st.integers(0, 15), data=st.data())
def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch(model, target, others, place, data):
    place = min(place, len(others))
    batch = [*others[:place], target, *others[place:]]
    paths = [True, False] if kernels.status().active else [False]
    for native in paths:
        alone = _run(model, [target], native)
        together = _run(model, batch, native)
        np.testing.assert_array_equal(together[0][place], alone[0][0], "prefill logits")
        if native or len(batch) == 1:
            np.testing.assert_array_equal(together[1][place], alone[1][0], "decoded tokens")
            np.testing.assert_array_equal(together[2][place], alone[2][0], "decode logits")
    batch_size = data.draw(st.integers(1, 16), label="batch_size")
    scored_alone = model.score([target], batch_size=1)[0]
    scored = model.score(batch, batch_size=batch_size)[place]
    np.testing.assert_array_equal(scored.logprobs, scored_alone.logprobs, "scored log-probabilities")


def test_the_xla_decode_step_is_the_same_at_every_batch_of_two_or_more(model):
    prompts = [[1, 2, 3, 4, 5], [9] * 30, [400, 500], [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]]
    pair = _run(model, [prompts[0], prompts[1]], native=False)
    many = _run(model, prompts * 2, native=False)
    np.testing.assert_array_equal(many[2][0], pair[2][0])
    np.testing.assert_array_equal(many[2][1], pair[2][1])
