"""The error contract: everything llama-jax raises on purpose derives from LlamaJaxError; a bad argument is an
InvalidArgumentError (also a ValueError) whose message says what was wrong; a failed in-graph (checkify) check
comes out as the class of the check that failed, chosen by the check, never by its text."""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import llama_jax
from llama_jax import (
    CapacityError,
    InvalidArgumentError,
    KVCache,
    LlamaJaxError,
    TokenIdError,
    UnsupportedDTypeError,
    decode_step,
    errors,
    extend,
    prefill,
    testing,
)
from llama_jax.passes import checks
from llama_jax.passes.generate import token_steps

PACKAGE = Path(llama_jax.__file__).parent


@functools.cache
def tiny_model() -> llama_jax.Model:
    return testing.tiny_model(seed=0)  # vocab 260, context 128


def test_every_error_class_derives_from_llama_jax_error_and_is_exported():
    classes = [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, BaseException)]
    assert len(classes) > 10
    for cls in classes:
        assert issubclass(cls, LlamaJaxError), f"{cls.__name__} does not derive from LlamaJaxError"
        exported = getattr(llama_jax, cls.__name__, None) is cls and cls.__name__ in llama_jax.__all__
        assert exported, f"{cls.__name__} is not exported by llama_jax (its import list and __all__)"
    assert {getattr(llama_jax, n) for n in llama_jax.__all__ if n.endswith("Error")} == set(classes)


def test_an_invalid_argument_is_also_a_value_error():
    assert issubclass(InvalidArgumentError, LlamaJaxError) and issubclass(InvalidArgumentError, ValueError)
    with pytest.raises(ValueError, match="batch_size"):
        tiny_model().score(["ab"], batch_size=0)


BAD_ARGUMENTS = {
    "generate: a prompt of ids": (
        lambda m: m.generate([1, 2]),
        r"generate takes a prompt string or a non-empty list of prompt strings \(generate_ids takes token ids\), got",
    ),
    "generate: no prompts": (lambda m: m.generate([]), r"non-empty list of prompt strings.*got \[\]"),
    "generate: an empty prompt": (lambda m: m.generate(""), "the prompt is empty; generation needs at least one token"),
    "generate: an empty prompt in a batch": (lambda m: m.generate(["a", ""]), "a prompt is empty"),
    "generate_ids: no ids": (lambda m: m.generate_ids([]), "the prompt is empty"),
    "stream: a list of prompts": (
        lambda m: list(m.stream(["a", "b"])),
        r"stream takes one prompt string or its token ids \(generate takes a list\), got \['a', 'b'\]",
    ),
    "stop: an empty string": (lambda m: m.generate("a", stop=""), "stop must be a non-empty string.*got ''"),
    "stop: not a string": (lambda m: m.generate("a", stop=["x", 3]), r"stop must be .*got \['x', 3\]"),
    "max_new_tokens: negative": (
        lambda m: m.generate("a", max_new_tokens=-1),
        "max_new_tokens must be an integer ≥ 0, got -1",
    ),
    "max_new_tokens: not an integer": (
        lambda m: m.generate("a", max_new_tokens=2.5),
        "max_new_tokens must be an integer ≥ 0, got 2.5",
    ),
    "token_steps: no prompts": (
        lambda m: next(token_steps(m.weights, m.config, [], 3)),
        "no prompts to generate from; give at least one prompt",
    ),
    "logits: no ids": (lambda m: m.logits([]), r"non-empty 1-D sequence of token ids, got shape \(0,\)"),
    "logits: a 2-D block": (lambda m: m.logits([[1, 2]]), r"1-D sequence of token ids, got shape \(1, 2\)"),
    "logits: ids that are not integers": (lambda m: m.logits(np.array([1.5, 2.0])), "must be integers.*float64"),
    "score: one token": (lambda m: m.score(["A"]), "a sequence to score needs at least 2 tokens.*got 'A'"),
    "score: an empty context": (
        lambda m: m.score([("", "ab")]),
        r"\(context, continuation\) pair needs tokens in both",
    ),
    "score: a triple": (lambda m: m.score([("a", "b", "c")]), r"\(context, continuation\), got 3 parts"),
    "score: batch_size 0": (lambda m: m.score(["ab"], batch_size=0), "batch_size must be a positive integer, got 0"),
    "score: batch_size True": (lambda m: m.score(["ab"], batch_size=True), "batch_size .* got True"),
    "perplexity: no scores": (lambda m: llama_jax.perplexity([]), "perplexity of no scored tokens; give at least one"),
    "KVCache.empty: batch 0": (
        lambda m: KVCache.empty(m.config, 0, 8),
        "a KV cache needs a positive batch and capacity, got batch 0, capacity 8",
    ),
    "KVCache.empty: capacity 0": (lambda m: KVCache.empty(m.config, 1, 0), "got batch 1, capacity 0"),
    "prefill: n = 0": (
        lambda m: prefill(m.weights, KVCache.empty(m.config, 1, 8), np.ones((1, 4), np.int32), m.config, n=0),
        "each row of a prefill of 4 slots holds 1 to 4 real tokens, got n = 0",
    ),
    "prefill: n past the block": (
        lambda m: prefill(m.weights, KVCache.empty(m.config, 1, 8), np.ones((1, 4), np.int32), m.config, n=[5]),
        r"holds 1 to 4 real tokens, got n = \[5\]",
    ),
    "sparse_act: an unknown name": (
        lambda m: llama_jax.sparse_act(resid=jnp.zeros(3)),
        r"no activation named \['resid'\]; the site names are n1, q, k",
    ),
}


@pytest.mark.parametrize("call, match", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS.keys())
def test_a_bad_argument_is_an_invalid_argument_error_saying_what_was_wrong(call, match):
    with pytest.raises(InvalidArgumentError, match=match) as info:
        call(tiny_model())
    assert info.type is InvalidArgumentError


def test_a_dtype_convert_does_not_offer_is_an_unsupported_dtype_error(tmp_path):
    with pytest.raises(UnsupportedDTypeError, match=r"dtype 'float16' is not offered; choose one of"):
        llama_jax.convert_gguf(tmp_path / "unread.gguf", tmp_path / "out", dtype="float16")


def test_no_builtin_exception_is_raised_on_purpose():
    """The source raises the package's classes: no `raise ValueError` (RuntimeError, TypeError, KeyError) in
    llama_jax/; re-raising (a bare `raise`) is fine."""
    banned = {"ValueError", "RuntimeError", "TypeError", "KeyError"}
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and node.exc is not None:
                raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(raised, ast.Name) and raised.id in banned and hasattr(builtins, raised.id):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: raise {raised.id}")
    assert not found, "\n".join(found)


# ---- in-graph checks: a failed checkify check comes out as its own class ----


@functools.cache
def checked_extend(window: int | None):
    """extend composed into a jitted function of one's own, as a caller of the pure API does."""
    config = tiny_model().config
    return jax.jit(
        checkify.checkify(functools.partial(extend, config=config, window=window), errors=checkify.user_checks)
    )


def cache_holding(filled: int, capacity: int) -> KVCache:
    m = tiny_model()
    return prefill(m.weights, KVCache.empty(m.config, 1, capacity), np.ones((1, filled), np.int32), m.config)[1]


def test_a_full_cache_in_graph_is_a_capacity_error():
    err, _ = checked_extend(None)(
        tiny_model().weights, cache_holding(3, 4), jnp.ones((1, 2), jnp.int32), jnp.array([2])
    )
    with pytest.raises(CapacityError, match=r"KV cache full: writing 2 position\(s\) after the 3 .* capacity 4; make"):
        checks.throw(err)


def test_a_window_shorter_than_the_positions_in_graph_is_a_capacity_error():
    err, _ = checked_extend(2)(tiny_model().weights, cache_holding(1, 8), jnp.ones((1, 2), jnp.int32), jnp.array([2]))
    with pytest.raises(CapacityError, match=r"attention window 2 is shorter than the positions written"):
        checks.throw(err)


def test_an_id_outside_the_vocabulary_in_graph_is_a_token_id_error():
    err, _ = checked_extend(None)(tiny_model().weights, cache_holding(1, 8), jnp.array([[1, 260]]), jnp.array([2]))
    with pytest.raises(TokenIdError, match=r"^token id 260 is outside the vocabulary \[0, 260\)$"):
        checks.throw(err)


def test_a_check_that_passes_raises_nothing():
    err, _ = checked_extend(None)(tiny_model().weights, cache_holding(1, 8), jnp.array([[1, 2]]), jnp.array([2]))
    assert checks.throw(err) is None


def test_a_check_is_mapped_by_its_declaration_not_by_text_that_looks_like_one():
    """A check of someone else's whose message reads like the cache's is not taken for a CapacityError."""

    def lookalike(x):
        checkify.check(x > 0, "KV cache full: {x}", x=x)
        return x

    err, _ = checkify.checkify(lookalike)(jnp.int32(0))
    with pytest.raises(checkify.JaxRuntimeError, match="KV cache full"):
        checks.throw(err)


def test_the_public_steps_refuse_a_full_cache_and_a_bad_id_with_the_same_classes():
    m = tiny_model()
    with pytest.raises(CapacityError, match=r"KV cache full.*capacity is 4"):
        decode_step(m.weights, cache_holding(4, 4), np.array([3]), m.config)
    with pytest.raises(CapacityError, match=r"KV cache full.*capacity is 4"):
        prefill(m.weights, cache_holding(3, 4), np.ones((1, 2), np.int32), m.config)
    with pytest.raises(TokenIdError, match=r"token id 260 is outside the vocabulary \[0, 260\)"):
        decode_step(m.weights, cache_holding(1, 8), np.array([260]), m.config)


def _total(logits):
    return jnp.sum(logits)


SEQUENCE_PASSES = {  # every public pass over one given sequence of ids (the tiny model: vocab 260, context 128)
    "logits": lambda m, ids: m.logits(ids),
    "activations": lambda m, ids: m.activations(ids, keep="y"),
    "score": lambda m, ids: m.score([ids]),
    "weight_grads": lambda m, ids: llama_jax.research.weight_grads(m, ids, _total),
    "embedding_grads": lambda m, ids: llama_jax.research.embedding_grads(m, ids, _total),
    "activation_grads": lambda m, ids: llama_jax.research.activation_grads(m, ids, _total, "y"),
    "logit_lens": lambda m, ids: llama_jax.research.logit_lens(m, ids),
    "run_with_cache": lambda m, ids: llama_jax.lens.run_with_cache(m, ids, "blocks.0.hook_resid_post"),
}


@pytest.mark.parametrize("run", SEQUENCE_PASSES.values(), ids=SEQUENCE_PASSES.keys())
def test_every_pass_over_a_sequence_refuses_an_id_past_the_vocabulary_and_a_length_past_the_context(run):
    """One check (`checks.check_ids`) at every door: the same error and words whichever pass is asked, before
    anything is compiled."""
    with pytest.raises(TokenIdError, match=r"token id 260 is outside the vocabulary \[0, 260\)"):
        run(tiny_model(), [1, 260, 2])
    with pytest.raises(CapacityError, match="129 tokens exceed the model's context of 128"):
        run(tiny_model(), [1] * 129)
