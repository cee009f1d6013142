"""The server's continuous-batching engine, in this process on a tiny model: every request's tokens equal
Model.generate_ids' alone, whatever joins or leaves the batch around it; a request the engine cannot run ends with
an error event and the engine serves the next one; a cancelled request leaves its slot."""

from __future__ import annotations

import queue
import threading

import pytest

from llama_jax import Sampling, testing
from llama_jax.serve.engine import Engine, Finished, Request, Token


@pytest.fixture(scope="module")
def running():
    model = testing.tiny_model(testing.tiny_config(layers=2))
    engine = Engine(model, max_batch=3, capacity=128, queue=8)
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    yield model, engine
    engine.stop()
    thread.join(60)
    assert not thread.is_alive()


def submit(engine, ids, max_tokens, sampling=None, logprobs=None) -> queue.Queue:
    events: queue.Queue = queue.Queue()
    engine.submit(Request(list(ids), max_tokens, sampling or Sampling(), events.put, logprobs))
    return events


def drain(events: queue.Queue) -> tuple[list[Token], Finished]:
    tokens = []
    while True:
        event = events.get(timeout=120)
        if isinstance(event, Finished):
            return tokens, event
        tokens.append(event)


def test_more_requests_than_slots_each_get_their_tokens_alone(running):
    """7 requests (greedy and seeded, of several lengths) through 3 slots: each request's ids are Model's alone."""
    model, engine = running
    prompts = [[5, 6, 7], [1], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0] * 3, [42, 42], [100, 3], [7] * 20, [250, 1, 2]]
    samplings = [Sampling(), Sampling(0.9, 20, 0.95, 3), Sampling(), Sampling(1.1, None, 1.0, 8), Sampling(),
                 Sampling(0.7, 5, 0.8, 1), Sampling()]  # fmt: skip
    lengths = [12, 30, 5, 17, 9, 21, 1]
    queues = [submit(engine, p, n, s, logprobs=2) for p, n, s in zip(prompts, lengths, samplings, strict=True)]
    for events, prompt, n, sampling in zip(queues, prompts, lengths, samplings, strict=True):
        tokens, end = drain(events)
        expected = model.generate_ids(prompt, n, sampling=sampling)
        assert [t.id for t in tokens] == expected[: len(tokens)] and len(tokens) == len(expected)
        assert end.reason == ("stop" if expected[-1] in model.eos_ids else "length")
        assert all(t.logprob <= 0 and len(t.top) == 2 for t in tokens)


def test_a_request_the_engine_cannot_run_ends_with_an_error_and_the_next_runs(running):
    model, engine = running
    tokens, end = drain(submit(engine, [5, 99999], 4))  # past the vocabulary (the server checks this first)
    assert not tokens and end.reason == "error" and "TokenIdError" in end.text
    tokens, end = drain(submit(engine, [5, 6], 4))
    assert [t.id for t in tokens] == model.generate_ids([5, 6], 4)


def test_a_cancelled_request_leaves_its_slot(running):
    """Cancelled after its first chunk, a request of 100 tokens ends "cancelled" at the next one, and its slot
    serves the next request."""
    model, engine = running
    events: queue.Queue = queue.Queue()
    request = Request([3, 4], 100, Sampling(), events.put)
    engine.submit(request)
    assert isinstance(events.get(timeout=120), Token)
    request.cancel()
    tokens, end = drain(events)
    assert end.reason == "cancelled" and len(tokens) < 99
    tokens, _ = drain(submit(engine, [3, 4], 5))
    assert [t.id for t in tokens] == model.generate_ids([3, 4], 5)


def test_a_request_of_several_choices_is_queued_whole_or_not_at_all():
    """submit(*requests) past the queue refuses them all (no choice left waiting), and a stopped engine refuses."""
    from llama_jax.errors import EngineStoppedError, QueueFullError

    engine = Engine(testing.tiny_model(testing.tiny_config(layers=1)), max_batch=1, capacity=64, queue=2)
    requests = [Request([1, 2], 3, Sampling(), lambda _: None) for _ in range(3)]
    with pytest.raises(QueueFullError, match="queue holds 2"):
        engine.submit(*requests)
    assert not engine.waiting
    engine.submit(*requests[:2])
    assert len(engine.waiting) == 2
    engine.stop()
    with pytest.raises(EngineStoppedError):
        engine.submit(requests[2])


def test_a_windowed_model_is_served_past_its_window_from_rows_of_the_window_only():
    """A model with a sliding window of 16 served in rows of 96 positions: the rows hold the window only (a ring),
    and requests run past it, joined mid-flight beside each other: each gets Model's tokens alone, and each token
    is the argmax of `forward`'s logits (no cache, the whole sequence under the window's mask) after the ones
    before it."""
    import dataclasses

    import jax
    import numpy as np

    from llama_jax import forward
    from llama_jax.passes.decode_batch import DecodeBatch

    config = dataclasses.replace(testing.tiny_config(layers=2, vocab=257), sliding_window=16)  # the byte tokens
    model = testing.tiny_model(config)
    assert DecodeBatch.empty(config, 2, 96).cache.ring
    whole = jax.jit(forward, static_argnames="config")  # one program a length, not an eager op each (8 s -> 2.5 s)
    engine = Engine(model, max_batch=2, capacity=96, queue=4)
    thread = threading.Thread(target=engine.run, daemon=True)
    thread.start()
    try:
        prompts = [[5, 6, 7], list(range(30, 50)), [9, 8]]  # the second longer than the window
        queues = [submit(engine, p, 40) for p in prompts]
        for events, prompt in zip(queues, prompts, strict=True):
            tokens, _ = drain(events)
            ids = [t.id for t in tokens]
            assert ids == model.generate_ids(prompt, 40)
            logits = np.asarray(whole(model.weights, np.asarray([prompt + ids]), config)[0][0])  # [T, V]
            assert ids == logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    finally:
        engine.stop()
        thread.join(60)
