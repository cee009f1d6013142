"""`llama-jax serve`, started by the tests on a free loopback port and stopped by them: the `openai` client's
completions, chat, streaming and log-probabilities; a request's text and every log-probability bit-identical alone
and among concurrent requests at random arrival times; every bad request a 4xx in the OpenAI error shape (and a
fuzz of request bodies: never a 5xx, never a dead server); the API key; the bounded queue's 429; a client that goes
away freeing its slot; SIGTERM finishing what is in flight."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.slow

from tests.served import NAME, Served  # noqa: E402 (after the extra's skips)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = Served(tmp_path_factory.mktemp("serve"), "--max-batch", "4")
    yield served
    assert served.stop(), served.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused")


def test_the_openai_client_completes_chats_and_streams(server, client, model):
    """Completions, chat and their streams with the `openai` package: greedy text equals Model.complete's in this
    process; the streamed pieces join to the whole answer; usage counts the tokens; /v1/models lists the model."""
    assert [m.id for m in client.models.list().data] == [NAME]
    r = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=12, temperature=0)
    expected = model.complete("The capital of France is", 12)
    assert r.choices[0].text == expected.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 12)
    ids = model.tokenizer.encode("Once upon a time")
    seeded = client.completions.create(model=NAME, prompt=ids, max_tokens=10, temperature=0.8, top_p=0.9, seed=5)
    assert seeded.choices[0].text == model.generate("Once upon a time", 10, temperature=0.8, top_p=0.9, seed=5)
    stream = client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=10, temperature=0.8,
                                       top_p=0.9, seed=5, stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in stream) == seeded.choices[0].text
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
    assert chat.choices[0].message.content == model.chat(messages, max_new_tokens=24)
    assert chat.choices[0].finish_reason == "stop"
    unbounded = client.chat.completions.create(model=NAME, messages=messages, temperature=0)  # up to the context
    assert unbounded.choices[0].message.content == chat.choices[0].message.content
    pieces = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces if c.choices) == chat.choices[0].message.content
    two = client.completions.create(model=NAME, prompt=["Hi", "Hello there"], max_tokens=4, n=2, temperature=1.0)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text != two.choices[1].text or two.choices[2].text != two.choices[3].text  # seed, seed + 1


def test_log_probabilities_are_the_model_s(server, client, model):
    """logprobs: each new token's log-probability and the top ones (the chosen one among them, greedy: first);
    with echo, the prompt's tokens are scored too, as Model.score scores them (within 1e-5)."""
    r = client.completions.create(model=NAME, prompt="The capital of France is", max_tokens=6, temperature=0,
                                  logprobs=3)  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and max(top, key=top.get) == token and top[token] == value and value <= 0
    text = "The capital of France is Paris"
    echo = client.completions.create(model=NAME, prompt=text, max_tokens=0, echo=True, logprobs=1, temperature=0)
    lp = echo.choices[0].logprobs
    assert echo.choices[0].text == text and lp.token_logprobs[0] is None
    scored = model.score([text])[0].logprobs
    np.testing.assert_allclose(lp.token_logprobs[1:], scored, atol=1e-5)
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    assert len(chat.choices[0].logprobs.content) == 3
    assert all(len(t.top_logprobs) == 2 for t in chat.choices[0].logprobs.content)


def test_a_chat_s_turns_reuse_its_history_and_get_model_chat_s_text(server, client, model):
    """Four turns of a chat, each re-sending the history: each answer is Model.chat's (a fresh prefill in this
    process), and the server's prompt cache (on by default) counts a hit for each turn after the first; with
    llama-server's cache_prompt false the prompt is prefilled whole, the same answer."""
    before = server.get("/health")["prompt_cache"]
    messages = []
    for question in ["What is the capital of France?", "And of Italy?", "Which is larger?", "Name a river there."]:
        messages.append({"role": "user", "content": question})
        reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=0)
        answer = reply.choices[0].message.content
        assert answer == model.chat(messages, max_new_tokens=24)
        messages.append({"role": "assistant", "content": answer})
    after = server.get("/health")["prompt_cache"]
    assert after["hits"] - before["hits"] >= 3 and after["positions_reused"] > before["positions_reused"]
    assert 0 < after["bytes"] <= after["limit_bytes"] == 1024 * 2**20
    again = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 24, "temperature": 0,
                                                 "cache_prompt": False})  # fmt: skip
    assert again.json()["choices"][0]["message"]["content"] == model.chat(messages, max_new_tokens=24)
    assert server.get("/health")["prompt_cache"]["hits"] == after["hits"]  # prefilled whole: no hit
    assert server.post("/v1/completions", {"prompt": "Hi", "cache_prompt": 1}).status_code == 400


REQUESTS = [
    {"prompt": "The capital of France is", "max_tokens": 20, "temperature": 0, "logprobs": 2},
    {"prompt": "Once upon a time,", "max_tokens": 28, "temperature": 0.9, "top_k": 40, "seed": 3, "logprobs": 1},
    {"prompt": "def fibonacci(n):", "max_tokens": 17, "temperature": 0.7, "top_p": 0.9, "seed": 11, "logprobs": 0},
    {"prompt": "Water boils at", "max_tokens": 9, "temperature": 0, "stop": ["\n"], "logprobs": 2},
    {"prompt": "List three fruits:", "max_tokens": 24, "temperature": 1.2, "seed": 7, "logprobs": 1, "n": 2},
    {"prompt": [504, 3575, 282], "max_tokens": 13, "temperature": 0, "logprobs": 2, "echo": True},
]


def test_a_request_gets_the_same_bits_alone_and_among_concurrent_ones(server):
    """Each request alone, then all of them (twice over) from concurrent clients at random arrival times, more
    than the server's 4 slots: every text, finish reason and log-probability is bit-identical to the request's alone
    (JSON floats round-trip float32 exactly)."""

    def answer(body):
        r = server.post("/v1/completions", body)
        assert r.status_code == 200, r.text
        return [(c["text"], c["finish_reason"], c["logprobs"]) for c in r.json()["choices"]]

    alone = [answer(body) for body in REQUESTS]
    rng = np.random.default_rng(0)
    order = rng.permutation(len(REQUESTS) * 2) % len(REQUESTS)
    delays = rng.uniform(0, 1.5, len(order))
    results: list = [None] * len(order)

    def client(k: int):
        time.sleep(delays[k])
        results[k] = answer(REQUESTS[order[k]])

    threads = [threading.Thread(target=client, args=(k,)) for k in range(len(order))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for k, i in enumerate(order):
        assert results[k] == alone[i], REQUESTS[i]


BAD = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": [1, 2, 99999999]}, 400, "prompt"),
    ({"prompt": "Hi", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "Hi", "max_tokens": "8"}, 400, "max_tokens"),
    ({"prompt": "Hi", "temperature": 3}, 400, "temperature"),
    ({"prompt": "Hi", "temperature": True}, 400, "temperature"),
    ({"prompt": "Hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "Hi", "top_k": -2}, 400, "top_k"),
    ({"prompt": "Hi", "seed": 2**32}, 400, "seed"),
    ({"prompt": "Hi", "seed": 2**32 - 1, "n": 2}, 400, "seed"),  # choice 1 would need seed 2^32
    ({"prompt": "Hi", "n": 0}, 400, "n"),
    ({"prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
    ({"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": "Hi", "stop": [""]}, 400, "stop"),
    ({"prompt": "Hi", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"prompt": "Hi", "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ({"prompt": "Hi", "suffix": "x"}, 400, "suffix"),
    ({"prompt": "Hi", "stream": "yes"}, 400, "stream"),
    ({"prompt": "Hi", "model": "gpt-4"}, 404, "model"),
    ({"prompt": "Hi", "max_tokens": 5000}, 400, "max_tokens"),
    ({"prompt": "Hi", "top_k": 2**40}, 400, "top_k"),
    ({"prompt": "Hi", "temperature": 10**400}, 400, "temperature"),
    (b'{"prompt": "Hi", "n": 1' + b"0" * 5000 + b"}", 400, None),  # past Python's 4300-digit integer limit
    (b"[" * 100000 + b"]" * 100000, 400, None),
]


def test_every_bad_request_is_a_4xx_in_the_openai_error_shape(server):
    """Malformed JSON, missing or wrong-typed fields, out-of-range values, unsupported parameters, another model,
    a request past the context (the message names both numbers), an unknown route: 4xx with {"error": {message,
    type, param, code}}; the server answers the next request as before."""
    for body, status, param in BAD:
        r = server.post("/v1/completions", body)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, (body, error)
    r = server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 5000})
    assert "2048 tokens" in r.json()["error"]["message"] and "5000" in r.json()["error"]["message"]
    chats = [{"messages": []}, {"messages": [{}]}, {"messages": [{"role": "user", "content": "x"}], "tools": []},
             {"messages": [{"role": "user", "content": "a " * 3000}]}]  # fmt: skip
    for body in chats:
        assert server.post("/v1/chat/completions", body).status_code == 400
    assert httpx.get(f"{server.url}/v1/nothing", timeout=10).status_code == 404
    assert server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_choice_j_samples_with_seed_plus_j_and_a_seed_past_2_32_is_a_400_never_a_wrap(server):
    """Choice j of n samples with the seed + j, each a seed in [0, 2^32): seed 2^32 - 2 with n = 2 gives choice 1
    the text of seed 2^32 - 1 alone; seed 2^32 - 1 with n = 2 would need seed 2^32 (wrapped to 0, seed 0's text)
    and is a 400 that names seed and the largest it may be."""
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 1.0}
    two = server.post("/v1/completions", {**body, "seed": 2**32 - 2, "n": 2})
    last = server.post("/v1/completions", {**body, "seed": 2**32 - 1})
    assert two.status_code == last.status_code == 200, (two.text, last.text)
    assert two.json()["choices"][1]["text"] == last.json()["choices"][0]["text"]
    r = server.post("/v1/completions", {**body, "seed": 2**32 - 1, "n": 2})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "seed", r.text
    assert "the 2 choices sample with seed + j (choice j)" in error["message"], error
    assert "4294967296 is past 2^32 - 1" in error["message"] and "at most 4294967294" in error["message"], error


def test_a_fuzz_of_request_bodies_gets_only_2xx_and_4xx(server):
    """300 random bodies (random keys from the API's and others, values of every JSON type and of nonsense
    sizes), sent by 4 clients at once (the server batches those it runs): only 2xx or 4xx, never a 5xx, and the
    server is alive after."""
    rng = np.random.default_rng(1)
    keys = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "echo", "logprobs",
            "stream", "model", "best_of", "frequency_penalty", "user", "stream_options", "bogus", "response_format",
            "grammar", "json_schema"]  # fmt: skip
    values = [None, True, False, 0, 1, -1, 2, 3.5, -0.0, 1e308, 2**40, "", "Hi", "\ud800", [], [1, 2], [-5],
              ["a"], [[1], "b"], {}, {"include_usage": True}, {"x": 1}, "x" * 5000, {"type": "json_object"},
              {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}, 'root ::= "a" | "b"',
              {"type": "array", "maxItems": 1}]  # fmt: skip
    bodies = []
    for _ in range(300):
        body = {str(rng.choice(keys)): values[rng.integers(len(values))] for _ in range(rng.integers(0, 6))}
        if rng.random() < 0.7:
            body.setdefault("prompt", "Hi")
        body["max_tokens"] = body.get("max_tokens", 2) if rng.random() < 0.5 else 2
        try:
            bodies.append((body, json.dumps(body).encode("utf-8", "surrogatepass")))
        except ValueError:
            continue

    def send(item):
        body, content = item
        r = server.post("/v1/completions", content)
        return body, r.status_code, r.text

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, bodies))
    statuses = Counter(status for _, status, _ in answers)
    print(f"\nfuzz statuses: {dict(statuses)}")
    for body, status, text in answers:
        assert status < 500, (body, text)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A server with an API key, one slot and a queue of one."""
    served = Served(tmp_path_factory.mktemp("guarded"), "--api-key", "sekrit", "--max-batch", "1", "--queue", "1")
    yield served
    assert served.stop(), served.log.read_text()[-3000:]


def test_with_an_api_key_every_endpoint_but_health_needs_it(guarded):
    body = {"prompt": "Hi", "max_tokens": 2}
    assert httpx.get(f"{guarded.url}/health", timeout=10).status_code == 200
    assert guarded.post("/v1/completions", body).status_code == 401
    r = guarded.post("/v1/completions", body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{guarded.url}/v1/models", timeout=10).status_code == 401
    assert guarded.post("/v1/completions", body, headers={"Authorization": "Bearer sekrit"}).status_code == 200


def test_past_the_queue_requests_get_429_and_a_client_that_leaves_frees_its_slot(guarded):
    """One slot, a queue of one: of several long requests at once, those past the queue get 429 with Retry-After.
    A streaming client that disconnects after two chunks frees the slot: the next request runs at once."""
    headers = {"Authorization": "Bearer sekrit"}
    statuses: list = []

    def long_request():
        r = guarded.post("/v1/completions", {"prompt": "Once", "max_tokens": 200, "temperature": 0}, headers=headers)
        statuses.append((r.status_code, r.headers.get("retry-after")))

    threads = [threading.Thread(target=long_request) for _ in range(5)]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(300)
    assert sorted(s for s, _ in statuses).count(200) >= 2 and (429, "1") in statuses, statuses
    body = {"prompt": "Once", "max_tokens": 1500, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{guarded.url}/v1/completions", json=body, headers=headers, timeout=300) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data:")
            if chunks == 2:
                break  # and the connection closes
    start = time.monotonic()
    r = guarded.post("/v1/completions", {"prompt": "Hi", "max_tokens": 2}, headers=headers)
    assert r.status_code == 200 and time.monotonic() - start < 30  # not after the 1500 tokens of the one that left


def test_sigterm_finishes_the_requests_in_flight_then_exits(tmp_path):
    """SIGTERM while a request decodes: the server stops accepting, answers that request whole, and exits."""
    served = Served(tmp_path)
    answer: dict = {}

    def long_request():
        answer["r"] = served.post("/v1/completions", {"prompt": "Once", "max_tokens": 120, "temperature": 0})

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(1.0)
    served.process.send_signal(signal.SIGTERM)
    thread.join(300)
    assert served.stop(), served.log.read_text()[-3000:]
    r = answer["r"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 120


def test_without_the_extra_the_command_says_how_to_install_it():
    code = "import sys; sys.modules['uvicorn'] = None; from llama_jax.cli import main; sys.exit(main(['serve']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"JAX_PLATFORMS": "cpu"})  # fmt: skip
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "pip install 'llama-jax[serve]'" in line


def evaluate(model_name: str, model_args: str, cache: Path) -> dict:
    """lm-eval's simple_evaluate of the repository's local task (examples/tasks/capitals) in a fresh process
    (offline): each sample's log-likelihoods and the accuracy."""
    code = f"""
import json
import llama_jax.lm_eval
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
r = simple_evaluate(model={model_name!r}, model_args={model_args!r}, tasks=["capitals"], batch_size=4,
                    task_manager=TaskManager(include_path="examples/tasks", include_defaults=False),
                    log_samples=True, bootstrap_iters=0)
samples = sorted(r["samples"]["capitals"], key=lambda s: s["doc_id"])
print(json.dumps({{"acc": r["results"]["capitals"]["acc,none"], "resps": [s["filtered_resps"] for s in samples]}}))
"""
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(cache)}
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900, cwd=root)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_lm_eval_against_the_server_scores_as_the_in_process_model(server, default_path, tmp_path):
    """lm-evaluation-harness's local-completions model against the server (token ids sent, echo and logprobs back)
    gives the in-process llama-jax model's log-likelihoods (within 1e-5), greedy flags and accuracy."""
    pytest.importorskip("lm_eval")
    from llama_jax import convert_gguf

    tokenizer = convert_gguf(default_path, tmp_path / "hf")  # the tokenizer lm-eval's client encodes with
    served = f"model={NAME},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer}"
    remote = evaluate("local-completions", served + ",tokenized_requests=True,max_retries=1", tmp_path / "a")
    local = evaluate("llama-jax", f"path={default_path}", tmp_path / "b")
    assert remote["acc"] == local["acc"]
    for got, want in zip(remote["resps"], local["resps"], strict=True):
        for (got_ll, got_greedy), (want_ll, want_greedy) in zip(got, want, strict=True):
            assert abs(float(got_ll) - float(want_ll)) <= 1e-5 and got_greedy == want_greedy, (got, want)
