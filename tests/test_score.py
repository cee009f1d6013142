"""Batch scoring: log-probabilities equal transformers' log_softmax on the default model, padding changes
nothing, pairs score their continuation, and a multiple-choice question picks its most likely answer."""

from __future__ import annotations

import numpy as np
import pytest

import llama_jax
from llama_jax import CapacityError, InvalidArgumentError, TokenIdError, perplexity
from llama_jax.passes import score as score_module
from tests.helpers import PROMPTS, count_traces, hf_logits

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is Paris.",
    "Water boils at 100 degrees Celsius at sea level, and freezes at zero.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman and his cat.",
    "Héllo wörld! 🙂",
    "1 2 3 4 5 6 7 8 9 10",
    "Hi there",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    PROMPTS[0],
]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - (np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) + x.max(-1, keepdims=True))


def test_padded_batch_logprobs_equal_transformers(model, hf_model):
    """Nine sequences of mixed lengths (2 to 70 tokens) in padded batches of 8: every scored token's log-prob
    within 1e-4 of log_softmax(transformers' float32 logits), the greedy flags equal its argmax."""
    items = TEXTS
    scores = model.score(items, batch_size=8)
    worst = 0.0
    for text, s in zip(items, scores, strict=True):
        ids = model.tokenizer.encode(text)
        logits = hf_logits(hf_model, ids)
        expected = log_softmax(logits)[np.arange(len(ids) - 1), ids[1:]]
        worst = max(worst, float(np.abs(s.logprobs - expected).max()))
        assert s.ids.tolist() == ids[1:]
        assert s.greedy == bool((logits[:-1].argmax(-1) == np.array(ids[1:])).all())
        assert s.total == pytest.approx(float(s.logprobs.astype(np.float64).sum()))
    print(f"\nmax |logprob - transformers|: {worst:.3g}")
    assert worst < 1e-4


def test_a_sequence_in_a_padded_batch_equals_it_scored_alone(model):
    together = model.score(TEXTS[:8], batch_size=8)
    for text, s in zip(TEXTS[:8], together, strict=True):
        (alone,) = model.score([text], batch_size=1)
        np.testing.assert_allclose(s.logprobs, alone.logprobs, rtol=1e-4, atol=1e-4)


def test_pairs_score_the_continuation_and_multiple_choice_picks_the_answer(model):
    """(context, continuation): the continuation's tokens only, as the tail of the whole sequence's scores."""
    context, choices = "Question: What is the capital of France?\nAnswer:", [" Berlin", " Paris", " Madrid"]
    scores = model.score([(context, c) for c in choices])
    assert choices[int(np.argmax([s.total for s in scores]))] == " Paris"
    (whole,) = model.score([context + " Paris"])
    n = scores[1].logprobs.size
    np.testing.assert_allclose(scores[1].logprobs, whole.logprobs[-n:], rtol=1e-4, atol=1e-4)
    ids = model.tokenizer.encode(context)
    (by_ids,) = model.score([(ids, model.tokenizer.encode(" Paris"))])
    np.testing.assert_array_equal(by_ids.logprobs, scores[1].logprobs)


def test_perplexity_is_exp_of_the_mean_negative_logprob(model):
    scores = model.score(TEXTS[:3])
    logprobs = np.concatenate([s.logprobs for s in scores]).astype(np.float64)
    assert perplexity(scores) == pytest.approx(np.exp(-logprobs.mean()))


def test_a_data_set_compiles_once_per_length_bucket(model, monkeypatch):
    """Twenty sequences of 2 to 20 tokens in batches of 4: one compilation per length (`score_length`) of the
    batches' longest, and none more for the same data again in another order."""
    words = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
    items = [" ".join(words[: 2 + i % 9] * (1 + i // 10)) for i in range(20)]
    lengths = sorted((len(model.tokenizer.encode(t)) for t in items), reverse=True)
    buckets = {llama_jax.core.buckets.score_length(lengths[i]) for i in range(0, 20, 4)}
    assert len(buckets) >= 2
    count_traces(monkeypatch, score_module, "score_batch", score_module.SCORE_JIT, n=len(buckets))
    model.score(items, batch_size=4)
    model.score(items[::-1], batch_size=4)


def test_bad_items_are_refused(model):
    with pytest.raises(InvalidArgumentError, match="at least 2 tokens"):
        model.score(["A"])
    with pytest.raises(InvalidArgumentError, match="needs tokens in both"):
        model.score([("", " Paris")])
    with pytest.raises(TokenIdError, match="outside the vocabulary"):
        model.score([[1, 2, 49152]])
    with pytest.raises(CapacityError, match="8193 tokens exceed the model's context of 8192"):
        model.score([[1] * 8193])
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        model.score(TEXTS[:2], batch_size=0)


def test_the_next_tokens_log_probabilities_are_those_each_one_token_continuation_gets(model):
    """with_next: Score.next[c] is the log-probability that scoring the sequence extended by token c gives c, bit
    for bit (one forward pass serves every one-token continuation: lm-eval's multiple choice); a one-token
    sequence has only its next row; is_argmax holds each scored token's greedy flag."""
    ids = model.tokenizer.encode("Question: What is the capital of France?\nAnswer:")
    (s,) = model.score([ids], with_next=True)
    assert s.next.shape == (model.config.vocab,) and s.is_argmax.shape == s.logprobs.shape
    assert s.greedy == bool(s.is_argmax.all())
    candidates = [model.tokenizer.encode(" " + c)[0] for c in ("Paris", "Lyon", "Berlin", "Rome")] + [0, 49151]
    extended = model.score([(ids, [c]) for c in candidates])
    for c, e in zip(candidates, extended, strict=True):
        assert e.logprobs[0] == s.next[c], c
        assert e.greedy == (int(np.argmax(s.next)) == c), c
    (one,) = model.score([ids[:1]], with_next=True)
    assert one.logprobs.size == 0 and one.next.shape == (model.config.vocab,)
    with pytest.raises(InvalidArgumentError, match="at least 2 tokens"):
        model.score([ids[:1]])
