"""`llama-jax serve` under hostile input, on loopback only, every loop bounded in count and time: a body past the
limit is refused with 413 at once and leaves no memory behind; bodies read whole (a server with a raised --max-body)
are parsed, rendered and tokenized off the event loop; slow and vanished clients hold nothing; a burst past the queue
gets 429s; malformed and hostile bodies get 4xx in the OpenAI error shape; SIGTERM mid-stream finishes the streams.
Meanwhile another client streams and /health is polled: neither waits more than a second. Every request's answer
after all of it is its answer alone, bit for bit."""

from __future__ import annotations

import itertools
import json
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytestmark = [pytest.mark.slow, pytest.mark.alone]

from llama_jax.serve.protocol import body_limit  # noqa: E402 (after the extra's skips)
from tests.served import Served  # noqa: E402

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
STALL = 1.0  # seconds: the most /health, or a running stream's next chunk, may be delayed by another request
MEMORY = 50  # MB: the most a refused large body may leave the server's resident memory grown by
WORDS = "The quick brown fox jumps over the lazy dog, and the dog sleeps on. "

REQUESTS = [
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "logprobs": 2}),
    ("/v1/completions", {"prompt": "Once upon a time,", "max_tokens": 20, "temperature": 0.9, "top_k": 40, "seed": 3}),
    ("/v1/completions", {"prompt": [504, 3575, 282], "max_tokens": 12, "temperature": 0.7, "top_p": 0.9, "seed": 11}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 12,
                              "temperature": 0, "logprobs": True, "top_logprobs": 2}),
]  # fmt: skip


def choices(reply: dict) -> list:
    """A reply's choices: (text, finish reason, log-probabilities) each."""
    return [(c.get("text") or c["message"]["content"], c["finish_reason"], c["logprobs"]) for c in reply["choices"]]


def answer(server: Served, path: str, body: dict) -> list:
    """A request's choices; asserts a 200."""
    r = server.post(path, body, headers=AUTH)
    assert r.status_code == 200, r.text
    return choices(r.json())


def body_of(n: int, **fields) -> bytes:
    """A completion body of about n bytes: a text prompt of ordinary words."""
    return json.dumps({"prompt": (WORDS * (n // len(WORDS) + 1))[:n], "max_tokens": 4, **fields}).encode()


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and (code is None or error["code"] == code), error
    return error


class Watch:
    """While open: a greedy stream of up to 500 new tokens after 510 (the batch attends to the same window all along:
    no new attention window to compile while it is watched), and /health polled every 50 ms. On closing, `delay` is
    the longest wait for the stream's next chunk (of 8 tokens) beyond its usual wait (the median), and `health` the
    slowest /health answer; the stream must still be running then (the whole time was watched)."""

    def __init__(self, server: Served):
        self.server, self.times, self.health_times = server, [], []
        self.done, self.finished = threading.Event(), False
        self.threads = [threading.Thread(target=self._stream), threading.Thread(target=self._poll)]

    def _stream(self):
        body = {"prompt": [504, 3575, 282] * 170, "max_tokens": 500, "temperature": 0, "stream": True}
        url = f"{self.server.url}/v1/completions"
        with httpx.stream("POST", url, json=body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                if self.done.is_set():
                    return  # (and the connection closes: the server cancels the request)
                if line.startswith("data:"):
                    self.times.append(time.monotonic())
                    self.finished |= line == "data: [DONE]"

    def _poll(self):
        while not self.done.is_set():
            start = time.monotonic()
            assert httpx.get(f"{self.server.url}/health", timeout=60).status_code == 200
            self.health_times.append(time.monotonic() - start)
            time.sleep(0.05)

    def __enter__(self) -> Watch:
        for t in self.threads:
            t.start()
        deadline = time.monotonic() + 120
        while len(self.times) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(self.times) >= 2, "the watched stream did not start"
        self.since = len(self.times) - 1
        return self

    def __exit__(self, *exc):
        end = time.monotonic()
        self.done.set()
        for t in self.threads:
            t.join(120)
        times = [t for t in self.times[self.since :] if t <= end]
        chunks = [t for t, before in zip(times[1:], times, strict=False) if t - before > 0.02] + [end]  # arrivals
        waits = sorted(b - a for a, b in itertools.pairwise([times[0], *chunks]))
        self.usual = waits[len(waits) // 2]
        self.delay, self.health = waits[-1] - self.usual, max(self.health_times)
        if exc[0] is None:
            assert not self.finished, "the watched stream ended before the faults did"
            print(f"\nthe stream's next chunk: usually {self.usual:.3f} s, at most {self.delay:.3f} s later;"
                  f" /health at most {self.health:.3f} s")  # fmt: skip


def warm(server: Served) -> None:
    """Compiles what the watched tests run beside the watched stream (sampled, with and without log-probabilities,
    a chat), so that no compile is taken for a stall."""
    with Watch(server):
        for path, body in REQUESTS:
            answer(server, path, body)
        assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers=AUTH).status_code == 200


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """As a user runs it: 4 slots, a queue of 8, an API key, the default body limit; each request's answer alone
    taken first, before any fault."""
    served = Served(tmp_path_factory.mktemp("hostile"), "--max-batch", "4", "--queue", "8", "--api-key", KEY)
    served.alone = [answer(served, path, body) for path, body in REQUESTS]
    warm(served)
    yield served
    served.stop()  # (the last test stops it itself, with SIGTERM mid-stream)


def test_a_body_past_the_limit_is_refused_at_once_and_leaves_no_memory_behind(hostile):
    """16 MB and 64 MB bodies (a prompt of ordinary words) get 413 from their Content-Length, a 64 MB chunked body
    is cut off at the limit: each in ≤ 1 s, the resident memory ≤ 50 MB larger after; a body at the limit is read
    (the limit printed at start is exact); a stream and /health are not delayed more than a second."""
    limit = int(re.search(r"request bodies up to (\d+) bytes", hostile.log.read_text()).group(1))
    bodies = {"16 MB": body_of(16_000_000), "64 MB": body_of(64_000_000)}
    chunked = bodies["64 MB"]
    padded = json.dumps({"prompt": "Hi", "max_tokens": 2, "user": ""}).encode()
    at_limit = padded[:-2] + b"x" * (limit - len(padded)) + padded[-2:]  # the user field fills it to the limit
    before = hostile.rss_mb()
    with Watch(hostile) as watch:
        for name, body in bodies.items():
            start = time.monotonic()
            error = assert_error(hostile.post("/v1/completions", body, headers=AUTH), 413, "request_too_large")
            assert time.monotonic() - start <= STALL, name
            assert f"is {len(body)} bytes" in error["message"] and str(limit) in error["message"]
        start = time.monotonic()
        pieces = (chunked[i : i + (1 << 20)] for i in range(0, len(chunked), 1 << 20))
        r = httpx.post(f"{hostile.url}/v1/completions", content=pieces, headers=AUTH, timeout=60)
        assert_error(r, 413, "request_too_large")
        assert time.monotonic() - start <= STALL
        assert_error(hostile.post("/v1/completions", at_limit + b" ", headers=AUTH), 413, "request_too_large")
        assert hostile.post("/v1/completions", at_limit, headers=AUTH).status_code == 200
    assert watch.delay <= STALL and watch.health <= STALL
    grown = hostile.rss_mb() - before
    print(f"resident memory {before:.0f} MB before, {grown:+.1f} MB after")
    assert grown <= MEMORY


@pytest.fixture(scope="module")
def roomy(tmp_path_factory):
    """A server whose --max-body (80 MB) lets the largest bodies in: they are read whole and prepared."""
    served = Served(tmp_path_factory.mktemp("roomy"), "--max-batch", "4", "--queue", "8", "--api-key", KEY,
                    "--max-body", "80000000")  # fmt: skip
    warm(served)
    yield served
    assert served.stop(), served.log.read_text()[-3000:]


def test_bodies_read_whole_are_prepared_off_the_event_loop(roomy):
    """With the limit raised, 16 MB and 64 MB prompts are read, parsed and refused for the context (a text by its
    length, before it is tokenized), a list of prompts each under that length is tokenized and refused, a 16 MB chat
    message is rendered and refused, a million ids refused: a stream and /health not delayed more than a second,
    the resident memory ≤ 50 MB larger after."""
    long_text = body_of(16_000_000), body_of(64_000_000)
    listed = json.dumps({"prompt": [(WORDS * 5000)[:300_000]] * 8, "max_tokens": 4}).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": (WORDS * 250_000)[:16_000_000]}]}).encode()
    ids = json.dumps({"prompt": list(range(1000)) * 1000, "max_tokens": 4}).encode()
    before = roomy.rss_mb()
    with Watch(roomy) as watch:
        for body in long_text:
            error = assert_error(roomy.post("/v1/completions", body, headers=AUTH), 400, "context_length_exceeded")
            assert "at least" in error["message"]  # known from its length: not tokenized
        error = assert_error(roomy.post("/v1/completions", listed, headers=AUTH), 400, "context_length_exceeded")
        assert "at least" not in error["message"]  # tokenized
        assert_error(roomy.post("/v1/chat/completions", chat, headers=AUTH), 400, "context_length_exceeded")
        assert_error(roomy.post("/v1/completions", ids, headers=AUTH), 400, "context_length_exceeded")
    assert watch.delay <= STALL and watch.health <= STALL
    grown = roomy.rss_mb() - before
    print(f"resident memory {before:.0f} MB before, {grown:+.1f} MB after")
    assert grown <= MEMORY


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "Hello", " ", "\n", "\t", "é", "漢字", "😀", "<|im_start|>", "123", "\x00"]),
                max_size=400))  # fmt: skip
def test_a_text_of_more_characters_than_the_bound_has_more_tokens(model, pieces):
    """The law the length check stands on: a text has at least len(text) / longest_token_bytes tokens (runs of
    spaces and newlines, the longest tokens, included)."""
    text = "".join(pieces)
    assert len(model.tokenizer.encode(text)) * model.tokenizer.longest_token_bytes >= len(text)


def test_the_default_limit_holds_any_prompt_the_context_takes(model):
    """Every token's text takes at most 6 × longest_token_bytes in JSON (as a client escapes it), so a prompt of
    2048 tokens, each the worst, fits the default limit; and no token covers more characters than the bound."""
    longest = model.tokenizer.longest_token_bytes
    texts = [model.tokenizer.decode([i]) for i in range(model.config.vocab)]
    assert max(len(t) for t in texts) <= longest
    worst = max(len(json.dumps(t)) - 2 for t in texts)
    assert 2048 * worst <= body_limit(2048, longest) - 1024  # (room for the rest of a request)
    print(f"\nlongest token {longest} bytes; worst in JSON {worst}; default limit {body_limit(2048, longest)} bytes")


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close() resets: a vanished client
    return s


def _head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()  # fmt: skip


def test_slow_and_vanished_clients_hold_no_slot_and_delay_no_one(hostile):
    """32 clients stuck in their headers, 8 stuck in their bodies, 2 gone mid-body and 4 gone mid-stream (their
    sockets reset): meanwhile a request is answered at once and /health too; after, every slot is free again."""
    held = []
    for _ in range(32):
        s = _connect(hostile.port)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthori")
        held.append(s)
    body = json.dumps({"prompt": "Hi", "max_tokens": 2}).encode()
    for _ in range(8):
        s = _connect(hostile.port)
        s.sendall(_head("/v1/completions", len(body)) + body[:5])
        held.append(s)
    for _ in range(2):
        s = _connect(hostile.port)
        s.sendall(_head("/v1/completions", len(body)) + body[:5])
        s.close()
    stream = json.dumps({"prompt": "Once upon a time", "max_tokens": 1000, "temperature": 0, "stream": True}).encode()
    for _ in range(4):
        s = _connect(hostile.port)
        s.sendall(_head("/v1/completions", len(stream)) + stream)
        seen = b""
        while b"data:" not in seen:
            seen += s.recv(4096)
        s.close()
    start = time.monotonic()
    assert httpx.get(f"{hostile.url}/health", timeout=10).status_code == 200
    assert time.monotonic() - start <= STALL
    assert answer(hostile, *REQUESTS[0]) == hostile.alone[0]
    deadline = time.monotonic() + 30
    while httpx.get(f"{hostile.url}/health", timeout=10).json()["busy"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert httpx.get(f"{hostile.url}/health", timeout=10).json()["busy"] == 0  # the vanished streams' slots free
    for s in held:
        s.close()


def test_a_burst_past_the_queue_gets_429s_and_the_admitted_their_answers(hostile):
    """40 requests at once at 4 slots and a queue of 8: each a 200 with its answer alone or a 429 with Retry-After;
    at least the 8 the queue holds are admitted."""
    results: list = [None] * 40

    def client(k: int):
        path, body = REQUESTS[k % len(REQUESTS)]
        r = hostile.post(path, body, headers=AUTH)
        results[k] = (r.status_code, r.headers.get("retry-after"), r.json())

    threads = [threading.Thread(target=client, args=(k,)) for k in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    statuses = [status for status, _, _ in results]
    print(f"\nburst: {statuses.count(200)} × 200, {statuses.count(429)} × 429")
    assert set(statuses) <= {200, 429} and statuses.count(429) >= 1 and statuses.count(200) >= 8
    for k, (status, retry, body) in enumerate(results):
        if status == 429:
            assert retry == "1" and body["error"]["code"] == "rate_limit_exceeded"
        else:
            assert choices(body) == hostile.alone[k % len(REQUESTS)]


HOSTILE = [
    (b'{"prompt": "caf\xe9 \xff\xfe"}', 400),  # not UTF-8
    (b'{"prompt": "Hi", "temperature": NaN}', 400),
    (b'{"prompt": "Hi", "top_p": Infinity}', 400),
    (b'{"prompt": "Hi", "user": -Infinity}', 400),  # not JSON, wherever it stands
    (b'"just a string"', 400),
    (b"null", 400),
    (b"", 400),
    ({"prompt": [49152]}, 400),  # past the vocabulary
    ({"prompt": [2**63]}, 400),
    ({"prompt": [-1]}, 400),
    ({"prompt": "Hi", "max_tokens": 2**63}, 400),
    ({"prompt": "Hi", "seed": 2**63}, 400),
    ({"prompt": "Hi", "n": 2**63}, 400),
    ({"prompt": "Hi", "n": 9}, 400),  # more choices than the queue holds: never admitted
    ({"prompt": ["Hi"] * 9}, 400),
    ({"prompt": "Hi", "top_k": 2**63}, 400),
    ({"prompt": "Hi", "logprobs": 2**63}, 400),
    ({"prompt": list(range(1000)) * 1000}, 413),  # a million ids: past the default limit
    ({"prompt": list(range(3000))}, 400),  # past the context
    (b"[" * 200_000 + b"]" * 200_000, 400),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, 400),
    ({"prompt": {"text": "Hi"}}, 400),
    ({"prompt": [[1, "a"]]}, 400),
    ({"prompt": [1.5]}, 400),
    ({"prompt": "Hi", "max_tokens": 2.0}, 400),
    ({"prompt": "Hi", "stop": 5}, 400),
    ({"prompt": "Hi", "echo": 1}, 400),
    ({"prompt": "Hi", "stream_options": []}, 400),
    ({"prompt": "Hi", "model": ["smollm2"]}, 400),
]
HOSTILE_CHATS = [
    {"messages": "Hi"},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": None}]},
    {"messages": [{"role": "tool", "content": "x"}]},
    {"messages": [{"role": "user", "content": "Hi"}], "n": 2**63},
    {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4000},
]


def test_malformed_and_hostile_bodies_get_4xx_in_the_openai_error_shape(hostile):
    """Invalid UTF-8, NaN and Infinity, ids past the vocabulary, 2^63 in every integer field, a million ids, deep
    nesting, wrong types: each its 4xx with {"error": {message, type, param, code}}; the server answers after."""
    for body, status in HOSTILE:
        assert_error(hostile.post("/v1/completions", body, headers=AUTH), status)
    for body in HOSTILE_CHATS:
        assert_error(hostile.post("/v1/chat/completions", body, headers=AUTH), 400)
    assert httpx.get(f"{hostile.url}/health", timeout=10).status_code == 200


def test_every_answer_after_the_faults_is_its_answer_alone(hostile):
    assert [answer(hostile, path, body) for path, body in REQUESTS] == hostile.alone


def test_sigterm_mid_stream_finishes_both_streams_then_exits(hostile):
    """SIGTERM while two streams are in flight: both end whole (every token, their finish reason, [DONE]), then the
    server exits cleanly."""
    body = {"prompt": "Once upon a time", "max_tokens": 80, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    ends: list = []
    started = threading.Barrier(3)

    def stream():
        lines = []
        with httpx.stream("POST", f"{hostile.url}/v1/completions", json=body, headers=AUTH, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):
                    lines.append(line)
                    if len(lines) == 1:
                        started.wait(60)
        ends.append(lines)

    threads = [threading.Thread(target=stream) for _ in range(2)]
    for t in threads:
        t.start()
    started.wait(60)
    hostile.process.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert hostile.stop(), hostile.log.read_text()[-3000:]
    for lines in ends:
        assert lines[-1] == "data: [DONE]"
        usage = json.loads(lines[-2][6:])["usage"]
        finish = json.loads(lines[-3][6:])["choices"][0]["finish_reason"]
        assert usage["completion_tokens"] == 80 and finish == "length", lines[-3:]


def test_a_body_limit_under_one_byte_is_a_usage_error():
    done = subprocess.run([sys.executable, "-m", "llama_jax.cli", "serve", "--max-body", "0"], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--max-body must be ≥ 1, got 0" in done.stderr, done.stderr[-2000:]
