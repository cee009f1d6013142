"""Constrained decoding's laws, on a tiny model (the byte tokenizer, end of sequence 256): a guided draw is the spec's
sampler over the logits with every token the grammar does not allow at -inf, bit for bit against the independent
reference; a guided text matches its grammar and ends with the end-of-sequence token; a guided row gets the same
tokens alone and in any batch, and a free row the same tokens beside a guided one as without it; a grammar that does
not compile is a GrammarError naming the problem."""

from __future__ import annotations

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from llama_jax import Grammar, GrammarError, InvalidArgumentError, Sampling, kernels, testing
from llama_jax.passes.decode_batch import DecodeBatch, RowSettings, masked, prefill_row
from llama_jax.passes.generate import token_steps
from llama_jax.passes.sampling import argmax_batch, sample_batch, uniform
from llama_jax.text.grammar import allowed_ids
from tests import reference_sampler as R

pytest.importorskip("llguidance")

CAPACITY = 64
EOS = 256
PATHS = [False, True] if kernels.status().active else [False]
WORD = Grammar.regex("[ab]{2,5}c")  # a text of 3 to 6 tokens, then the end of sequence


@pytest.fixture(scope="module")
def model():
    return testing.tiny_model(testing.tiny_config(layers=2))


def _masks(rng: np.random.Generator, rows: int, vocab: int) -> np.ndarray:
    """Each row's mask [rows, words]: row 0 every token, row 1 one token, the others a random tenth."""
    allowed = rng.random((rows, vocab)) < 0.1
    allowed[np.arange(rows), rng.integers(vocab, size=rows)] = True  # at least one
    allowed[0], allowed[1] = True, False
    allowed[1, rng.integers(vocab)] = True
    words = -(-vocab // 32)
    bits = np.zeros((rows, words * 32), np.uint64)
    bits[:, :vocab] = allowed
    packed = (bits.reshape(rows, words, 32) << np.arange(32, dtype=np.uint64)).sum(axis=-1)  # bit i of word w: 32w+i
    return packed.astype(np.uint32).view(np.int32)


def test_a_masked_draw_is_the_spec_s_sampler_over_the_allowed_logits():
    """masked(): the allowed logits' bits unchanged, the others -inf; the batched sampler and argmax over them draw
    what the reference sampler draws from those logits (top-k and top-p then count allowed tokens only)."""
    rng = np.random.default_rng(0)
    rows, vocab = 6, 300
    logits = (3 * rng.standard_normal((rows, vocab))).astype(np.float32)
    masks = _masks(rng, rows, vocab)
    allowed = [set(allowed_ids(m, vocab).tolist()) for m in masks]
    assert len(allowed[0]) == vocab and len(allowed[1]) == 1
    got = np.asarray(masked(jnp.asarray(logits), jnp.asarray(masks)))
    for b in range(rows):
        keep = np.isin(np.arange(vocab), sorted(allowed[b]))
        np.testing.assert_array_equal(got[b][keep], logits[b][keep])
        assert np.all(got[b][~keep] == -np.inf)
    assert np.asarray(argmax_batch(jnp.asarray(got))).tolist() == [R.argmax(row) for row in got]
    for temperature, top_k, top_p in [(0.7, None, 1.0), (1.3, 5, 1.0), (1.0, 40, 0.8), (0.5, None, 0.6)]:
        seeds, ns = np.arange(rows, dtype=np.uint32) + 11, np.arange(rows, dtype=np.int32) * 3
        draws = sample_batch(
            jnp.asarray(got), jnp.full(rows, temperature, jnp.float32), jnp.full(rows, top_k or 0, jnp.int32),
            jnp.full(rows, top_p, jnp.float32), jnp.asarray(seeds), jnp.asarray(ns), width=vocab,
        )  # fmt: skip
        for b in range(rows):
            want = R.sample(got[b], temperature, top_k, top_p, np.float32(uniform(int(seeds[b]), int(ns[b]))))
            assert int(draws[b]) == want and want in allowed[b]


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("sampling", [Sampling(), Sampling(1.2, None, 1.0, 5), Sampling(0.8, 7, 0.9, 2)])
def test_a_guided_text_matches_its_grammar_and_then_ends(model, sampling, native):
    """Greedy and sampled: each text of a batch matches the grammar whole, its ids end with the end-of-sequence
    token, and it is the text the same prompt gets alone."""
    m = model if not native else testing.tiny_model(model.config, native="auto")
    guided = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, sampling.seed, grammar=WORD)
    prompts = ["hello", "a", "xyz xyz xyz"]
    together = m.complete(prompts, 20, sampling=guided)
    for k, (prompt, done) in enumerate(zip(prompts, together, strict=True)):
        assert re.fullmatch("[ab]{2,5}c", done.text), done.text
        assert done.ids[-1] == EOS and len(done.ids) == len(done.text) + 1
        seed = sampling.seed + k  # sequence k of a batch draws with seed + k
        alone = m.complete(prompt, 20, sampling=Sampling(sampling.temperature, sampling.top_k, sampling.top_p, seed,
                                                         grammar=WORD))  # fmt: skip
        assert alone.ids == done.ids


@pytest.mark.parametrize("native", PATHS)
def test_a_free_row_beside_a_guided_one_gets_its_tokens_alone(model, native):
    """Row 0 free (sampled), row 1 guided by a JSON schema: the guided chunks are one token, and row 0's tokens and
    log-probabilities are those it gets alone, eight tokens a chunk; row 1's text is valid JSON under its schema."""
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "yy"]}}, "required": ["k"]}
    free, sampled = [5, 6, 7, 8], Sampling(0.9, 20, 0.95, 3)
    guide = model.guide(Grammar.json_schema(schema))

    def joined(batch, row, ids, sampling, guide=None):
        settings = RowSettings.of(sampling, sampling.seeds(1), model.config.vocab)
        prefilled = prefill_row(model.weights, model.config, ids, CAPACITY, native)
        return batch.join(row, prefilled, settings, guide)

    def run(batch, tokens):
        kept = []
        while sum(len(t) for t, _ in kept) < tokens:
            batch, out, lp = batch.advance(model.weights, model.config, native, logprobs=2)
            kept.append((out[0], lp.chosen[0]))
        return batch, [np.concatenate(part)[:tokens] for part in zip(*kept, strict=True)]

    empty = DecodeBatch.empty(model.config, 2, CAPACITY)
    batch = joined(joined(empty, 0, free, sampled), 1, [1, 2, 3], Sampling(), guide)
    assert batch.guided and batch.steps(model.config) == 1
    batch, beside = run(batch, 16)
    drawn = batch.ids[1][3:].tolist()
    text = b"".join(model.tokenizer.token_bytes(i) for i in drawn[: drawn.index(EOS)]).decode()
    assert json.loads(text)["k"] in ("x", "yy") and guide.done, text
    assert not batch.guided and batch.steps(model.config) == 8  # its text has ended: whole chunks again
    _, alone = run(joined(DecodeBatch.empty(model.config, 2, CAPACITY), 0, free, sampled), 16)
    for got, want in zip(beside, alone, strict=True):
        np.testing.assert_array_equal(got, want)
    assert not batch.leave(1).guided


@pytest.mark.parametrize(
    "make, problem",
    [
        (lambda: Grammar.json_schema({"type": "foo"}), "Invalid type"),
        (lambda: Grammar.json_schema("{not json"), "not valid JSON"),
        (lambda: Grammar.json_schema([1, 2]), "is an object"),
        (lambda: Grammar.gbnf('root ::= "a" rule'), "Rule 'rule' not found"),
        (lambda: Grammar.gbnf(""), "non-empty"),
        (lambda: Grammar.lark("start: undefined_rule"), "undefined_rule"),
        (lambda: Grammar.regex("(ab"), "regex"),
        (lambda: Grammar.response_format({"type": "xml"}), "response_format must be"),
        (lambda: Grammar.response_format({"type": "json_schema"}), "needs"),
        (lambda: Grammar.response_format({"type": "json_schema", "json_schema": {"schema": {}, "x": 1}}), "'x'"),
        (lambda: Grammar.response_format({"type": "text", "schema": {}}), "'schema'"),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_grammar_error_naming_the_problem(make, problem):
    with pytest.raises(GrammarError, match=re.escape(problem)):
        make()


def test_a_grammar_without_its_guides_is_refused(model):
    with pytest.raises(InvalidArgumentError, match="needs each sequence's guide"):
        next(token_steps(model.weights, model.config, [[1, 2]], 4, Sampling(grammar=WORD)))


def test_sampling_takes_a_grammar_value_and_response_format_reads_openai_s_shapes():
    with pytest.raises(InvalidArgumentError, match=r"grammar takes a llama_jax\.Grammar"):
        Sampling(grammar='{"type": "object"}')
    assert Grammar.response_format({"type": "text"}) is None
    assert Grammar.response_format({"type": "json_object"}) == Grammar.json_object()
    schema = {"type": "array", "items": {"type": "integer"}}
    spec = {"type": "json_schema", "json_schema": {"name": "ints", "schema": schema, "strict": True}}
    assert Grammar.response_format(spec) == Grammar.json_schema(schema) == Grammar.json_schema(json.dumps(schema))
    assert Grammar.response_format({"type": "json_object", "schema": schema}) == Grammar.json_schema(schema)
