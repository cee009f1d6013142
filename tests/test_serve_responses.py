"""The server's response bodies (`serve.responses`), built without a server: each parses as the `openai` client's
type of it, and holds what tests/test_serve.py asserts of the served ones (log-probabilities per token and their
top ones, echo's unscored first token, usage counting each prompt once, the error shape)."""

from __future__ import annotations

import pytest

from llama_jax.errors import APIError
from llama_jax.serve import responses
from llama_jax.serve.engine import PromptLogprobs, Token

openai_types = pytest.importorskip("openai.types")
chat_types = pytest.importorskip("openai.types.chat")

TEXTS = {1: "The", 2: " capital", 3: " is", 4: " Paris", 5: " Rome"}
TOKENS = [Token(4, " Paris", -0.25, ((4, -0.25), (5, -1.5))), Token(3, " is", -0.5, ((3, -0.5), (2, -2.0)))]


def text_of(i: int) -> str:
    return TEXTS[i]


def head(chat: bool) -> responses.Head:
    return responses.Head("cmpl-0", 1700000000, "smollm2", chat)


def test_a_completion_with_logprobs_is_the_openai_client_s_completion():
    """Each new token's log-probability and its top ones ({text: logprob}, the chosen one the best); unasked, a
    completion's logprobs are null, not left out."""
    logprobs = responses.choice_logprobs(False, TOKENS, text_of)
    choice = responses.choice(False, 0, " Paris is", "length", logprobs)
    body = responses.completion(head(False), [choice], responses.token_usage([[1, 2]], [2]))
    r = openai_types.Completion.model_validate(body)
    lp = r.choices[0].logprobs
    assert r.object == "text_completion" and r.choices[0].text == " Paris is"
    assert lp.tokens == [" Paris", " is"] and lp.token_logprobs == [-0.25, -0.5]
    assert lp.top_logprobs == [{" Paris": -0.25, " Rome": -1.5}, {" is": -0.5, " capital": -2.0}]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (2, 2, 4)
    plain = responses.choice(False, 0, "x", "stop", None)
    assert plain == {"index": 0, "finish_reason": "stop", "text": "x", "logprobs": None}


def test_echo_puts_the_prompt_s_scores_first_its_first_token_unscored():
    """(null for the first token, as OpenAI's legacy completions and lm-eval's local-completions read them; the
    `openai` client's type does not allow it, so this one is checked as a dict.)"""
    scored = PromptLogprobs((None, -3.0), ((), ((2, -3.0), (5, -4.0))))
    lp = responses.choice_logprobs(False, TOKENS, text_of, [1, 2], scored)
    assert lp == {
        "tokens": ["The", " capital", " Paris", " is"],
        "token_logprobs": [None, -3.0, -0.25, -0.5],
        "top_logprobs": [None, {" capital": -3.0, " Rome": -4.0}, {" Paris": -0.25, " Rome": -1.5},
                         {" is": -0.5, " capital": -2.0}],
    }  # fmt: skip
    assert responses.prompt_logprobs([1, 2], scored, text_of) == {k: v[:2] for k, v in lp.items()}  # a stream's


def test_usage_counts_each_prompt_once_whatever_n():
    """Two prompts, n 2: four choices, each prompt's tokens counted once."""
    assert responses.token_usage([[1, 2, 3], [4]], [5, 6, 7, 8]) == {
        "prompt_tokens": 4, "completion_tokens": 26, "total_tokens": 30,
    }  # fmt: skip


def test_a_chat_completion_with_logprobs_is_the_openai_client_s():
    logprobs = responses.choice_logprobs(True, TOKENS, text_of)
    body = responses.completion(head(True), [responses.choice(True, 0, " Paris is", "stop", logprobs)],
                                responses.token_usage([[1, 2, 3]], [2]))  # fmt: skip
    r = chat_types.ChatCompletion.model_validate(body)
    assert r.object == "chat.completion" and r.choices[0].message.content == " Paris is"
    content = r.choices[0].logprobs.content
    assert [t.token for t in content] == [" Paris", " is"] and content[0].bytes == list(b" Paris")
    assert [[(t.token, t.logprob) for t in c.top_logprobs] for c in content] == [
        [(" Paris", -0.25), (" Rome", -1.5)], [(" is", -0.5), (" capital", -2.0)],
    ]  # fmt: skip
    assert "logprobs" not in responses.choice(True, 0, "x", "stop", None)  # a chat's are left out unasked


def test_stream_chunks_are_the_openai_client_s_and_join_to_the_answer():
    """A chat stream: the role first, a piece per token, a last piece with the finish reason (its delta empty when
    no text is left), then the usage alone; a completion's pieces carry text and logprobs (null unasked)."""
    chat = head(True)
    chunks = [responses.chunk(chat, [responses.chat_role(0)])]
    chunks += [responses.chunk(chat, [responses.piece(True, 0, t.text, None, None)]) for t in TOKENS]
    chunks += [responses.chunk(chat, [responses.piece(True, 0, "", "stop", None)])]
    chunks += [responses.chunk(chat, [], responses.token_usage([[1]], [2]))]
    parsed = [chat_types.ChatCompletionChunk.model_validate(c) for c in chunks]
    assert all(c.object == "chat.completion.chunk" for c in parsed) and parsed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in parsed if c.choices) == " Paris is"
    assert chunks[-2]["choices"][0]["delta"] == {} and parsed[-2].choices[0].finish_reason == "stop"
    assert parsed[-1].choices == [] and parsed[-1].usage.completion_tokens == 2
    entries = responses.token_logprobs(False, TOKENS[:1], text_of)
    last = responses.piece(False, 1, " Paris", "length", entries)  # (the client's type wants a finish reason)
    c = openai_types.Completion.model_validate(responses.chunk(head(False), [last]))
    assert c.choices[0].text == " Paris" and c.choices[0].logprobs.top_logprobs == [{" Paris": -0.25, " Rome": -1.5}]
    assert responses.piece(False, 0, "x", None, None) == {"index": 0, "finish_reason": None, "text": "x",
                                                          "logprobs": None}  # fmt: skip


@pytest.mark.parametrize(
    ("status", "kind"),
    [(400, "invalid_request_error"), (401, "authentication_error"), (404, "not_found_error"),
     (413, "invalid_request_error"), (429, "invalid_request_error"), (500, "server_error"), (501, "server_error"),
     (503, "server_error")],
)  # fmt: skip
def test_every_error_status_has_the_openai_error_shape(status, kind):
    body = responses.error(APIError("what was wrong", "n", status, "some_code"))
    assert body == {"error": {"message": "what was wrong", "type": kind, "param": "n", "code": "some_code"}}


def test_the_models_list_is_the_openai_client_s():
    body = responses.models("smollm2", 1700000000)
    assert body["object"] == "list" and [openai_types.Model.model_validate(m).id for m in body["data"]] == ["smollm2"]
