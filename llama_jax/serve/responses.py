"""The OpenAI API's response bodies: completions and chat completions, whole and as stream chunks, their
log-probabilities and usage, errors, the models list, embeddings, and llama-server's and vLLM's /tokenize and
/detokenize.

Pure functions of plain data (a token's text comes from the `token_text` given; the engine's events are only read),
so that every shape is tested without a server and `app` only sends them; `protocol` checks the requests.
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from llama_jax.errors import APIError
from llama_jax.serve.engine import PromptLogprobs, Token

TokenText = Callable[[int], str]  # a token id's text (the tokenizer's decode of it alone)

ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    500: "server_error",
    501: "server_error",
    503: "server_error",
}


def error(e: APIError) -> dict:
    """{"error": {message, type, param, code}}; the type by the status (400, 413, 429: invalid_request_error)."""
    kind = ERROR_TYPES.get(e.status, "invalid_request_error")
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}}


def models(name: str, created: int) -> dict:
    """/v1/models: the one model served."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "llama-jax"}]}


@dataclasses.dataclass(frozen=True)
class Head:
    """What every body of one answer repeats: its id, when it was made (Unix seconds) and the model's name; and
    whether it answers a chat (the chat shapes) or a completion."""

    id: str
    created: int
    model: str
    chat: bool


def token_usage(prompts: Sequence[Sequence[int]], made: Sequence[int]) -> dict:
    """The token counts of an answer: each prompt's tokens once (whatever n), every choice's new ones."""
    prompt = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt, "completion_tokens": sum(made), "total_tokens": prompt + sum(made)}


def token_logprobs(chat: bool, tokens: Sequence[Token], token_text: TokenText) -> dict:
    """New tokens' log-probabilities: a chat's {"content": [{token, logprob, bytes, top_logprobs}]}, a
    completion's {tokens, token_logprobs, top_logprobs: [{token: logprob}]}."""
    if chat:
        content = [
            {
                "token": token_text(t.id),
                "logprob": t.logprob,
                "bytes": list(token_text(t.id).encode()),
                "top_logprobs": [{"token": token_text(i), "logprob": lp} for i, lp in t.top],
            }
            for t in tokens
        ]
        return {"content": content}
    return {
        "tokens": [token_text(t.id) for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [{token_text(i): lp for i, lp in t.top} for t in tokens],
    }


def prompt_logprobs(ids: Sequence[int], scored: PromptLogprobs, token_text: TokenText) -> dict:
    """An echoed prompt's tokens scored, in a completion's logprobs shape (the first token has no log-probability
    nor top ones: None)."""
    return {
        "tokens": [token_text(i) for i in ids],
        "token_logprobs": list(scored.logprobs),
        "top_logprobs": [None] + [{token_text(i): lp for i, lp in top} for top in scored.top[1:]],
    }


def choice_logprobs(
    chat: bool,
    tokens: Sequence[Token],
    token_text: TokenText,
    ids: Sequence[int] = (),
    scored: PromptLogprobs | None = None,
) -> dict:
    """A whole choice's log-probabilities: with echo (`scored`: its prompt `ids` scored) the prompt's first."""
    entries = token_logprobs(chat, tokens, token_text)
    if scored is None:
        return entries
    first = prompt_logprobs(ids, scored, token_text)
    return {k: first[k] + entries[k] for k in entries}


def choice(chat: bool, index: int, text: str, reason: str | None, logprobs: dict | None) -> dict:
    """One choice of a whole answer: a chat's message or a completion's text, its finish reason and its
    log-probabilities where asked (None: a completion's are null, a chat's left out)."""
    body: dict = {"index": index, "finish_reason": reason}
    if chat:
        body["message"] = {"role": "assistant", "content": text}
    else:
        body["text"] = text
    if logprobs is not None:
        body["logprobs"] = logprobs
    elif not chat:
        body["logprobs"] = None
    return body


def completion(head: Head, choices: list[dict], usage: dict) -> dict:
    """A whole answer: a chat.completion or a text_completion."""
    kind = "chat.completion" if head.chat else "text_completion"
    body = {"id": head.id, "object": kind, "created": head.created, "model": head.model}
    return body | {"choices": choices, "usage": usage}


def chat_role(index: int) -> dict:
    """A chat stream's first piece of a choice: the assistant's role, no text yet."""
    return {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}


def piece(chat: bool, index: int, text: str, reason: str | None, logprobs: dict | None) -> dict:
    """A choice's piece of a stream chunk: its new text (a chat's delta, {} in a last piece with no text left), in
    its last piece the finish reason, and its log-probabilities where asked (a completion's null otherwise)."""
    body: dict = {"index": index, "finish_reason": reason}
    if chat:
        body["delta"] = {"content": text} if text or reason is None else {}
        if logprobs is not None:
            body["logprobs"] = logprobs
    else:
        body |= {"text": text, "logprobs": logprobs}
    return body


def chunk(head: Head, pieces: list[dict], usage: dict | None = None) -> dict:
    """A stream chunk: a chat.completion.chunk or a text_completion, with its choices' pieces (none in the last one,
    which carries the usage where asked)."""
    kind = "chat.completion.chunk" if head.chat else "text_completion"
    body = {"id": head.id, "object": kind, "created": head.created, "model": head.model, "choices": pieces}
    if usage is not None:
        body["usage"] = usage
    return body


def embeddings(name: str, vectors: Sequence[np.ndarray], as_base64: bool, prompt_tokens: int) -> dict:
    """/v1/embeddings: one entry per input, in order, each vector a list of floats or (as_base64) OpenAI's base64 of
    its little-endian float32 bytes; the usage counts the inputs' tokens."""
    data = [
        {
            "object": "embedding",
            "index": k,
            "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if as_base64 else v.tolist(),
        }
        for k, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": name, "usage": usage}


def tokens(ids: Sequence[int], pieces: Sequence[bytes] | None, capacity: int) -> dict:
    """/tokenize: the ids (with pieces: each as {"id", "piece"}, the piece its text, or the list of its bytes where
    they are not whole UTF-8 characters, as llama-server gives it), their count and the context (vLLM's)."""
    listed: list = list(ids)
    if pieces is not None:
        listed = [{"id": i, "piece": _piece(b)} for i, b in zip(ids, pieces, strict=True)]
    return {"tokens": listed, "count": len(ids), "max_model_len": capacity}


def _piece(token: bytes) -> str | list[int]:
    try:
        return token.decode("utf-8")
    except UnicodeDecodeError:
        return list(token)


def text(decoded: str) -> dict:
    """/detokenize: the text, under llama-server's name (content) and vLLM's (prompt)."""
    return {"content": decoded, "prompt": decoded}
