"""The decode batch's laws, on a tiny model: a row joined mid-flight, beside others joining and leaving, gets the
tokens and log-probabilities it gets alone in the batch, and the tokens generation gives it (both users hold their
settings as RowSettings; the engine's batch sorts the whole vocabulary, generation's only its top_k); a row whose
top_k the batch's width cannot hold is refused; a prefill that scores the prompt gives the prefill's bits and
Model.score's."""

from __future__ import annotations

import numpy as np
import pytest

from llama_jax import InvalidArgumentError, Sampling, kernels, testing
from llama_jax.passes.decode_batch import CHUNK, DecodeBatch, RowSettings, prefill_row
from llama_jax.passes.generate import token_steps

CAPACITY = 64
ROWS = 3
PATHS = [False, True] if kernels.status().active else [False]


@pytest.fixture(scope="module")
def model():
    return testing.tiny_model(testing.tiny_config(layers=2))


def _settings(model, sampling: Sampling) -> RowSettings:
    return RowSettings.of(sampling, sampling.seeds(1), model.config.vocab)


def _join(model, batch, row, ids, sampling, native):
    return batch.join(row, prefill_row(model.weights, model.config, ids, CAPACITY, native), _settings(model, sampling))


def _advance(model, batch, native, kept, row):
    """One chunk; row's tokens and log-probabilities appended to kept."""
    batch, tokens, lp = batch.advance(model.weights, model.config, native, logprobs=2)
    kept.append((tokens[row], lp.chosen[row], lp.ids[row], lp.top[row]))
    return batch


def _stacked(kept):
    return [np.concatenate(part) for part in zip(*kept, strict=True)]


@pytest.mark.parametrize("native", PATHS)
def test_a_row_joined_mid_flight_gets_its_tokens_alone(model, native):
    """B joins row 2 after A's first chunk; A leaves and C takes row 0 after B's first; row 1 stays free. B's
    tokens and log-probabilities equal B's alone in the batch, bit for bit, and its tokens generation's."""
    a, b, c = [5, 6, 7, 8], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11, 12], [250, 1]
    sampled, greedy = Sampling(0.9, 20, 0.95, 3), Sampling()
    batch = _join(model, DecodeBatch.empty(model.config, ROWS, CAPACITY), 0, a, greedy, native)
    batch = _advance(model, batch, native, [], 0)
    batch = _join(model, batch, 2, b, sampled, native)
    together: list = []
    batch = _advance(model, batch, native, together, 2)
    batch = _join(model, batch.leave(0), 0, c, Sampling(1.1, None, 1.0, 8), native)
    for _ in range(2):
        batch = _advance(model, batch, native, together, 2)
    assert batch.written.tolist() == [len(c) + 2 * CHUNK, 0, len(b) + 3 * CHUNK]

    alone: list = []
    batch = _join(model, DecodeBatch.empty(model.config, ROWS, CAPACITY), 2, b, sampled, native)
    for _ in range(3):
        batch = _advance(model, batch, native, alone, 2)
    for got, want in zip(_stacked(together), _stacked(alone), strict=True):
        np.testing.assert_array_equal(got, want)
    generated = np.stack(list(token_steps(model.weights, model.config, [b], 3 * CHUNK, sampled, native=native)))
    np.testing.assert_array_equal(_stacked(together)[0], generated[:, 0])


def test_the_width_is_the_largest_top_k_the_batch_holds(model):
    """Generation's batch sorts its rows' top_k, the engine's the vocabulary; a row that needs more is refused."""
    settings = RowSettings.of(Sampling(0.9, 20), np.arange(2, dtype=np.uint32), model.config.vocab)
    prompts = [np.array([5, 6, 7]), np.array([8, 9])]
    batch = DecodeBatch.prefill(model.weights, model.config, prompts, CAPACITY, settings)
    assert batch.width == 20 and DecodeBatch.empty(model.config, ROWS, CAPACITY).width == model.config.vocab
    with pytest.raises(InvalidArgumentError, match="sorts 260 candidates joins a batch that sorts 20"):
        _join(model, batch, 0, [1, 2], Sampling(0.9), native=False)


@pytest.mark.parametrize("native", PATHS)
def test_a_scored_prefill_is_the_prefill_and_model_score(model, native):
    """The layers run once for both: the logits and cache of the plain prefill, and Model.score's bits."""
    ids = [5, 17, 200, 3, 3, 9, 250, 1, 1, 2, 40, 41, 42, 43, 7, 8, 9]  # 17 tokens: a 32-slot bucket
    plain = prefill_row(model.weights, model.config, ids, CAPACITY, native)
    scored = prefill_row(model.weights, model.config, ids, CAPACITY, native, scored_top=4)
    np.testing.assert_array_equal(np.asarray(scored.logits), np.asarray(plain.logits))
    for got, want in [(scored.cache.k, plain.cache.k), (scored.cache.v, plain.cache.v)]:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert scored.scored.chosen.shape == (1, len(ids) - 1) and scored.scored.ids.shape == (1, len(ids) - 1, 4)
    scorer = testing.tiny_model(model.config, native="auto" if native else "off")  # the same (seeded) weights
    np.testing.assert_array_equal(scored.scored.chosen[0], scorer.score([ids])[0].logprobs)
    assert (scored.scored.top[0, :, 0] >= scored.scored.chosen[0]).all()
