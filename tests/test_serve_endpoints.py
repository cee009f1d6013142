"""`llama-jax serve`'s embeddings (OpenAI's /v1/embeddings) and tokenizer endpoints (llama-server's and vLLM's
/tokenize and /detokenize): the vectors equal `Model.embed`'s and the final norm's output pooled, a batch the same
bits as each input alone, base64 the same floats; ids and pieces as the model's tokenizer gives them, round trips,
and every bad body a 4xx (a fuzz of bodies: never a 5xx)."""

from __future__ import annotations

import base64
import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")
pytestmark = pytest.mark.slow

from tests.served import NAME, Served  # noqa: E402 (after the extra's skips)

TEXTS = ["The capital of France is Paris.", "Hello", "ünïcödé 😀 日本語 <|im_start|>", "a b c " * 40]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = Served(tmp_path_factory.mktemp("endpoints"), "--max-batch", "2")
    yield served
    assert served.stop(), served.log.read_text()[-3000:]


def test_embeddings_are_the_final_norm_pooled_and_a_batch_is_each_alone(server, model):
    """The openai client's embeddings: the in-process Model.embed's bits, which are `activations`' nf at the last
    position over its L2 norm (or the mean, unnormalised, when asked); a list the same bits as each alone; base64
    the same float32 bytes; ids as input too; usage counts the tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    together = client.embeddings.create(model=NAME, input=TEXTS)
    vectors = np.array([d.embedding for d in together.data], np.float32)
    np.testing.assert_array_equal(vectors, model.embed(TEXTS))
    assert together.usage.prompt_tokens == sum(len(model.tokenizer.encode(t)) for t in TEXTS)
    for k, text in enumerate(TEXTS):
        alone = client.embeddings.create(model=NAME, input=text).data[0].embedding
        np.testing.assert_array_equal(np.array(alone, np.float32), vectors[k])
        nf = model.activations(model.tokenizer.encode(text), keep=())["nf"]
        np.testing.assert_array_equal(vectors[k], nf[-1] / np.linalg.norm(nf[-1]))
    packed = server.post("/v1/embeddings", {"input": TEXTS[:2], "encoding_format": "base64"}).json()
    for k, entry in enumerate(packed["data"]):
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(entry["embedding"]), "<f4"), vectors[k])
    ids = model.tokenizer.encode(TEXTS[0])
    by_ids = server.post("/v1/embeddings", {"input": ids, "pooling": "mean", "normalize": False}).json()
    nf = model.activations(ids, keep=())["nf"]
    np.testing.assert_array_equal(np.array(by_ids["data"][0]["embedding"], np.float32), nf.mean(0, dtype=np.float32))


def test_tokenize_gives_the_models_ids_and_pieces_and_detokenize_inverts_it(server, model):
    """llama-server's shape (content; add_special default false; with_pieces: each piece its text, or its bytes
    where it splits a character) and vLLM's (prompt; add_special_tokens default true; messages as the chat
    template renders them; count and max_model_len); /detokenize gives the text back (under content and prompt)."""
    tokenizer = model.tokenizer
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special=False)
        answer = server.post("/tokenize", {"content": text}).json()
        assert answer["tokens"] == ids and answer["count"] == len(ids) and answer["max_model_len"] == 2048
        assert server.post("/tokenize", {"prompt": text}).json()["tokens"] == tokenizer.encode(text)
        pieces = server.post("/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
        assert [p["id"] for p in pieces] == ids
        joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
        assert joined == text.encode()
        back = server.post("/detokenize", {"tokens": ids}).json()
        assert back["content"] == back["prompt"] == text
    split = server.post("/tokenize", {"content": "😀", "with_pieces": True}).json()["tokens"]
    assert any(isinstance(p["piece"], list) for p in split)  # a byte-level vocabulary splits the emoji's bytes
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert server.post("/tokenize", {"messages": messages}).json()["tokens"] == model.chat_ids(messages)


BAD = [
    ("/v1/embeddings", {}, "input"),
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ""}, "input"),
    ("/v1/embeddings", {"input": [10**9]}, "input"),
    ("/v1/embeddings", {"input": "Hi", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "Hi", "dimensions": 64}, "dimensions"),
    ("/v1/embeddings", {"input": "Hi", "pooling": "cls"}, "pooling"),
    ("/v1/embeddings", {"input": "Hi", "normalize": "yes"}, "normalize"),
    ("/v1/embeddings", {"input": "Hi", "model": "other"}, "model"),
    ("/v1/embeddings", {"input": "Hi", "bogus": 1}, "bogus"),
    ("/v1/embeddings", {"input": "x " * 5000}, "max_tokens"),
    ("/tokenize", {}, "content"),
    ("/tokenize", {"content": "a", "prompt": "b"}, "content"),
    ("/tokenize", {"content": 5}, "content"),
    ("/tokenize", {"content": "a", "add_special_tokens": True}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/tokenize", {"messages": [], "add_generation_prompt": False}, "add_generation_prompt"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", [], None),
]


def test_every_bad_body_is_a_400_naming_its_parameter(server):
    for path, body, param in BAD:
        r = server.post(path, body)
        error = r.json()["error"]
        assert r.status_code in (400, 404), (path, body, r.text)
        assert error["param"] == param and error["message"], (path, body, error)
    assert server.post("/tokenize", b"{not json").status_code == 400


def test_a_fuzz_of_bodies_gets_only_2xx_and_4xx(server):
    """300 random bodies over the three endpoints' keys and others, 4 clients at once: never a 5xx, the server
    alive after."""
    rng = np.random.default_rng(2)
    keys = ["input", "encoding_format", "dimensions", "pooling", "normalize", "user", "model", "content",
            "prompt", "messages", "add_special", "add_special_tokens", "with_pieces", "add_generation_prompt",
            "tokens", "x"]  # fmt: skip
    values = [None, True, False, 0, 1, -1, 576, 3.5, "", "Hi", "\ud800", "last", "mean", "base64", [], [1, 2],
              [-5], ["a"], [[1], "b"], {}, [{"role": "user", "content": "hi"}], "x" * 3000]  # fmt: skip
    bodies = []
    for _ in range(300):
        body = {str(rng.choice(keys)): values[rng.integers(len(values))] for _ in range(rng.integers(0, 5))}
        path = str(rng.choice(["/v1/embeddings", "/tokenize", "/detokenize"]))
        if rng.random() < 0.5:  # the endpoint's own field, so that some bodies get through
            body.setdefault({"/v1/embeddings": "input", "/tokenize": "content"}.get(path, "tokens"), [1, 2])
        try:
            bodies.append((path, json.dumps(body).encode("utf-8", "surrogatepass")))
        except ValueError:
            continue

    def send(item):
        path, content = item
        r = server.post(path, content)
        return path, content, r.status_code, r.text

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(send, bodies))
    print(f"\nfuzz statuses: {dict(Counter(status for *_, status, _ in answers))}")
    for path, content, status, text in answers:
        assert status < 500, (path, content, text)
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
