"""The server's prompt cache, on a tiny model: a prompt prefilled after another prompt's first positions gets the
bits a fresh prefill gives it (its logits and every position's keys and values), on both paths; the cache keeps
prompts by recency within its bytes, a longer prompt replacing the ones it begins with; the engine with the cache
gives every turn of several chats, alone and interleaved, the tokens and log-probabilities it gives them without,
and counts its hits."""

from __future__ import annotations

import dataclasses
import queue
import threading

import numpy as np
import pytest

from llama_jax import InvalidArgumentError, Sampling, kernels, testing
from llama_jax.passes.decode_batch import prefill_after, prefill_row
from llama_jax.serve.engine import Engine, Finished, Request
from llama_jax.serve.prefixes import LEAST_REUSED, PromptCache

CAPACITY = 128
PATHS = [False, True] if kernels.status().active else [False]


@pytest.fixture(scope="module")
def tiny():
    return testing.tiny_model(testing.tiny_config(layers=2))


def _ids(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 256, n).tolist()


@pytest.mark.parametrize("native", PATHS)
@pytest.mark.parametrize("kept, n", [(16, 17), (20, 40), (31, 33), (50, 100), (64, 65), (16, 128)])
def test_a_prompt_prefilled_after_a_held_one_is_its_fresh_prefill(tiny, native, kept, n):
    """The logits after the prompt and the keys and values of its n positions equal prefill_row's bit for bit,
    where the held prompt is longer than what it gives (its other positions never read) or exactly that."""
    ids = _ids(n)
    fresh = prefill_row(tiny.weights, tiny.config, ids, CAPACITY, native)
    for held_ids in (ids[:kept], [*ids[:kept], 7, 7, 7]):
        held = prefill_row(tiny.weights, tiny.config, held_ids, CAPACITY, native)
        after = prefill_after(tiny.weights, tiny.config, held, kept, ids, CAPACITY, native)
        if after is None:  # the rest's bucket does not fit after the kept positions
            assert kept + max(16, 1 << (n - kept - 1).bit_length()) > CAPACITY
            continue
        np.testing.assert_array_equal(np.asarray(after.logits), np.asarray(fresh.logits))
        for got, want in [(after.cache.k, fresh.cache.k), (after.cache.v, fresh.cache.v)]:
            np.testing.assert_array_equal(np.asarray(got)[:, :, :, :n], np.asarray(want)[:, :, :, :n])
        assert int(after.cache.length[0]) == n and after.ids.tolist() == ids


def test_a_held_prompt_that_does_not_begin_so_is_refused(tiny):
    held = prefill_row(tiny.weights, tiny.config, _ids(20), CAPACITY)
    with pytest.raises(InvalidArgumentError, match="does not begin with the first 20"):
        prefill_after(tiny.weights, tiny.config, held, 20, _ids(30, seed=1), CAPACITY)
    windowed = testing.tiny_model(dataclasses.replace(testing.tiny_config(layers=1), sliding_window=8))
    with pytest.raises(InvalidArgumentError, match="cannot reuse"):
        prefill_after(windowed.weights, windowed.config, held, 20, _ids(30), CAPACITY)


def test_the_cache_keeps_the_longest_by_recency_within_its_bytes(tiny):
    def made(ids):
        return prefill_row(tiny.weights, tiny.config, ids, CAPACITY)

    a, b = _ids(40, 1), _ids(40, 2)
    one = made(a)
    size = one.cache.k.nbytes + one.cache.v.nbytes + one.logits.nbytes  # a 64-slot bucket's
    cache = PromptCache(2 * size)
    cache.keep(one)
    assert cache.longest([*a[: LEAST_REUSED - 1], 1]) is None  # too little shared
    held, shared = cache.longest([*a[:30], 1, 2])
    assert held is one and shared == 30
    assert cache.longest(a) == (one, 40)  # itself: every position, and its logits
    assert cache.longest(a[:35])[1] == 34  # all but the last, whose logits are computed
    longer = made([*a, 5, 5])  # begins with a: replaces it
    cache.keep(longer)
    assert list(cache.entries) == [tuple(longer.ids.tolist())] and cache.bytes == size
    cache.keep(made(b))
    cache.longest(a)  # the longer one, used again: the most recent
    cache.keep(made(_ids(40, 3)))  # past the limit: b, the least recently used, goes
    assert [k[:1] for k in cache.entries] == [(a[0],), (_ids(40, 3)[0],)] and cache.bytes == 2 * size
    cache.record(30)
    cache.record(0)
    assert cache.stats() | {"bytes": 0} == {"entries": 2, "bytes": 0, "limit_bytes": 2 * size, "hits": 1,
                                           "misses": 1, "positions_reused": 30}  # fmt: skip
    small = PromptCache(size - 1)
    small.keep(one)  # larger than the whole cache: not kept
    assert not small.entries


def _run(engine: Engine, requests: list[tuple[list[int], Sampling]], tokens: int) -> list[list[tuple]]:
    """Each request's (id, logprob) pairs, all submitted at once."""
    queues = []
    for ids, sampling in requests:
        events: queue.Queue = queue.Queue()
        engine.submit(Request(ids, tokens, sampling, events.put, logprobs=3))
        queues.append(events)
    out = []
    for events in queues:
        got = []
        while not isinstance(event := events.get(timeout=120), Finished):
            got.append((event.id, event.logprob, event.top))
        assert event.reason in ("length", "stop"), event
        out.append(got)
    return out


def _chats(m, capacity: int, first: list[list[int]], following, samplings: list[Sampling], tokens: int) -> None:
    """Chats of four turns through two engines of model m, one without the prompt cache and one with: turn k+1 of
    chat c is following(c, turn k's prompt, its answer's ids, k). Every turn's tokens, log-probabilities and top
    tokens are the same from both, submitted together (under load) and, at the second turn, one by one (alone); the
    cached engine reuses every history."""
    engines = [Engine(m, max_batch=2, capacity=capacity, queue=8, prompt_cache=limit) for limit in (0, 1 << 30)]
    threads = [threading.Thread(target=e.run, daemon=True) for e in engines]
    for thread in threads:
        thread.start()
    try:
        chats = first
        for turn in range(4):
            requests = list(zip(chats, samplings, strict=True))
            without = _run(engines[0], requests, tokens)
            together = _run(engines[1], requests, tokens)
            alone = [_run(engines[1], [r], tokens)[0] for r in requests] if turn == 1 else together
            assert together == without == alone, turn
            if turn < 3:
                chats = [following(c, chat, [t[0] for t in answer], turn) for c, (chat, answer) in
                         enumerate(zip(chats, without, strict=True))]  # fmt: skip
        stats = engines[1].prompts.stats()
        print(f"\nprompt cache: {stats}")
        assert stats["hits"] >= 3 * len(first) and engines[0].prompts.stats()["hits"] == 0, stats
    finally:
        for engine, thread in zip(engines, threads, strict=True):
            engine.stop()
            thread.join(60)


@pytest.mark.parametrize("native", PATHS)
def test_every_turn_of_interleaved_chats_gets_its_bits_without_the_cache(tiny, native):
    """Three chats, each turn its history, the answer it got and a new message (random ids), greedy and sampled."""
    m = testing.tiny_model(tiny.config, native="auto" if native else "off")
    samplings = [Sampling(), Sampling(0.9, 20, 0.95, 3), Sampling(1.2, None, 1.0, 8)]
    first = [_ids(18 + 5 * c, seed=10 + c) for c in range(3)]
    _chats(m, CAPACITY, first, lambda c, chat, answer, turn: [*chat, *answer, *_ids(4 + turn, seed=turn)], samplings, 6)


@pytest.mark.slow
def test_the_real_model_s_chats_get_their_bits_without_the_cache(model):
    """SmolLM2-135M-Instruct: two chats under its chat template, each turn the messages so far, the answer's text
    and a new question, greedy and sampled."""
    questions = [
        "What is the capital of France?",
        "And of Italy?",
        "Which one is larger?",
        "Name a river there.",
        "Tell me a short story about a cat.",
        "Make it sadder.",
        "Now give it a title.",
        "Translate it.",
    ]
    histories = [[{"role": "user", "content": questions[0]}], [{"role": "user", "content": questions[4]}]]

    def following(c, _prompt, answer, turn):
        histories[c] += [
            {"role": "assistant", "content": model.tokenizer.decode(answer, skip_special=True)},
            {"role": "user", "content": questions[4 * c + turn + 1]},
        ]
        return model.chat_ids(histories[c])

    first = [model.chat_ids(h) for h in histories]
    _chats(model, 2048, first, following, [Sampling(), Sampling(0.8, 40, 0.95, 5)], 24)
