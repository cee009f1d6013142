"""The OpenAI API's request bodies, checked: every parameter the server takes, its type and range, and the ones it
refuses (a value that would change the answer in a way the server does not implement is a 400, never ignored).

A bad body raises `APIError` with the OpenAI error's message and the parameter it names; the app answers its status
(400 here) with the body `responses.error` builds.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from llama_jax.errors import APIError, GrammarError, MissingExtraError, SamplingError
from llama_jax.passes.sampling import SEEDS, consecutive_seeds
from llama_jax.text.grammar import Grammar

MAX_N = 16  # choices a request
MAX_STOPS = 4
TOP_LOGPROBS = 20  # the most top log-probabilities a token reports (OpenAI's limit; the engine's one compiled width)
JSON_BYTES_PER_BYTE = 6  # the most a byte of text takes in JSON: a control character as \u00XX
ENVELOPE_BYTES = 64 * 1024  # the JSON around a prompt: its other parameters, a chat's roles and structure


def body_limit(capacity: int, longest_token_bytes: int) -> int:
    """The default largest request body: one prompt as long as the context can hold, each token the longest, every
    byte of it escaped, plus the JSON around it. A larger body holds no prompt the model could take (a list of
    several long prompts needs --max-body raised)."""
    return capacity * longest_token_bytes * JSON_BYTES_PER_BYTE + ENVELOPE_BYTES


def _not_json(constant: str) -> float:
    raise APIError(f"the request body is not valid JSON ({constant} is not a JSON value)")


def parse_json(raw: bytes) -> Any:
    """A request body as JSON (RFC 8259: UTF-8, no NaN or Infinity); APIError otherwise."""
    try:
        return json.loads(raw, parse_constant=_not_json)
    except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, an integer of > 4300 digits, too deep
        raise APIError(f"the request body is not valid JSON ({str(e)[:200]})") from e


@dataclasses.dataclass(frozen=True)
class Settings:
    """What a completion request asks for, checked (prompts as texts or ids, one entry a prompt)."""

    prompts: list[str | list[int]]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int | None
    seeds: tuple[int, ...]  # choice j's (of n): seed + j, `consecutive_seeds`
    stop: tuple[str, ...]
    n: int
    echo: bool
    logprobs: int | None
    stream: bool
    include_usage: bool
    grammar: Grammar | None  # what every choice's text must match (None: anything)
    grammar_field: str | None  # the body's field that gave it (response_format, grammar, json_schema)
    cache_prompt: bool  # llama-server's: whether the prompt may take a kept prompt's positions (the same bits)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    number = isinstance(v, (int, float)) and not isinstance(v, bool)  # (an int of any size compares exactly)
    if not number or (isinstance(v, float) and not math.isfinite(v)) or not low <= v <= high:
        raise APIError(f"{name} must be a number in [{low}, {high}], got {v!r:.60}", name)
    return float(v)


def _integer(body: dict, name: str, default: int | None, low: int, high: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or v < low or (high is not None and v > high):
        bound = f"≥ {low}" if high is None else f"in [{low}, {high}]"
        raise APIError(f"{name} must be an integer {bound}, got {v!r:.60}", name)
    return v


def _flag(body: dict, name: str) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise APIError(f"{name} must be true or false, got {v!r}", name)
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(s, str) and s for s in stops):
        raise APIError(f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them, got {v!r}", "stop")
    return tuple(stops)


def _no_op_only(body: dict, defaults: dict[str, Any]) -> None:
    """Parameters the server takes only at the value that changes nothing (penalties 0, no logit bias, ...)."""
    for name, neutral in defaults.items():
        if name in body and body[name] not in (None, neutral):
            raise APIError(f"{name} is not supported (only {neutral!r}); remove it", name)


def _unknown(body: dict, known: set[str]) -> None:
    extra = sorted(set(body) - known)
    if extra:
        raise APIError(f"unsupported parameter {extra[0]!r}; this server takes {', '.join(sorted(known))}", extra[0])


_NO_OPS = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "best_of": 1}
_SHARED = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options"}
_SHARED |= {"user", "response_format", "grammar", "json_schema", "cache_prompt", *_NO_OPS}
COMPLETION_KEYS = _SHARED | {"prompt", "echo", "logprobs"}
CHAT_KEYS = _SHARED | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}


def _prompts(v: Any, vocab: int) -> list[str | list[int]]:
    """prompt: a text, a list of ids, or a list of either (each a prompt)."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and v and all(_is_int(i) for i in v):
        return [_ids(v, vocab)]
    if isinstance(v, list) and v and all(isinstance(p, (str, list)) for p in v):
        return [p if isinstance(p, str) else _ids(p, vocab) for p in v]
    raise APIError("prompt must be a text, a list of token ids, or a non-empty list of either", "prompt")


def _ids(v: list, vocab: int) -> list[int]:
    if not v or not all(_is_int(i) for i in v):
        raise APIError("a prompt of token ids must be a non-empty list of integers", "prompt")
    bad = [i for i in v if not 0 <= i < vocab]
    if bad:
        raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
    return list(v)


def _common(body: dict, max_tokens_default: int, max_tokens: str = "max_tokens") -> dict:
    _no_op_only(body, _NO_OPS)
    n = _integer(body, "n", 1, 1, MAX_N)
    try:
        seeds = consecutive_seeds(_integer(body, "seed", 0, 0, SEEDS - 1), n, "choice")
    except SamplingError as e:
        raise APIError(str(e), "seed") from e
    options = body.get("stream_options")
    if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}):
        raise APIError('stream_options takes {"include_usage": true|false}', "stream_options")
    usage = bool(options and _flag(options, "include_usage"))
    top_k = _integer(body, "top_k", None, 0, 2**31 - 1)  # past the vocabulary: the whole vocabulary
    return {
        "max_tokens": _integer(body, max_tokens, max_tokens_default, 0),
        "temperature": _number(body, "temperature", 1.0, 0.0, 2.0),
        "top_p": _number(body, "top_p", 1.0, 0.0, 1.0),
        "top_k": top_k or None,
        "seeds": seeds,
        "stop": _stop(body),
        "n": n,
        "stream": _flag(body, "stream"),
        "include_usage": usage,
        **dict(zip(("grammar", "grammar_field"), _grammar(body), strict=True)),
        "cache_prompt": body.get("cache_prompt") is None or _flag(body, "cache_prompt"),
    }


GRAMMAR_KEYS = ("response_format", "grammar", "json_schema")


def _grammar(body: dict) -> tuple[Grammar | None, str | None]:
    """What the text must match and the field that says it: OpenAI's response_format (text, json_object,
    json_schema), or llama-server's grammar (GBNF) or json_schema (a schema); at most one of them. One that cannot be
    compiled is a 400 naming the problem; without llguidance installed, a 501."""
    given = [key for key in GRAMMAR_KEYS if body.get(key) is not None]
    if len(given) > 1:
        raise APIError(f"give one of {', '.join(given)}, not several", given[1])
    if not given:
        return None, None
    key = given[0]
    make = {"response_format": Grammar.response_format, "grammar": Grammar.gbnf, "json_schema": Grammar.json_schema}
    try:
        return make[key](body[key]), key
    except GrammarError as e:
        raise APIError(str(e), key) from e
    except MissingExtraError as e:
        raise APIError(f"this server cannot constrain decoding: {e}", key, status=501, code="not_implemented") from e


def _check_top_p(body: dict) -> None:
    if body.get("top_p") == 0:
        raise APIError("top_p must lie in (0, 1]", "top_p")


def completion_settings(body: Any, vocab: int) -> Settings:
    """The settings of a /v1/completions body (OpenAI's defaults: max_tokens 16, temperature 1; seed 0 where none
    is given, so that an answer is the same every time)."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    _unknown(body, COMPLETION_KEYS)
    if "prompt" not in body:
        raise APIError("prompt is required", "prompt")
    _check_top_p(body)
    common = _common(body, 16)
    logprobs = _integer(body, "logprobs", None, 0, TOP_LOGPROBS)
    return Settings(_prompts(body["prompt"], vocab), echo=_flag(body, "echo"), logprobs=logprobs, **common)


def chat_settings(body: Any) -> tuple[list[dict[str, str]], Settings]:
    """The messages and settings of a /v1/chat/completions body (max_tokens or max_completion_tokens; default: the
    room left in the context, given by the app)."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    _unknown(body, CHAT_KEYS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list of {role, content} objects", "messages")
    for m in messages:
        if not (
            isinstance(m, dict)
            and set(m) <= {"role", "content", "name"}
            and m.get("role") in ("system", "user", "assistant")
            and isinstance(m.get("content"), str)
        ):
            raise APIError('each message must be {"role": system|user|assistant, "content": a string}', "messages")
    _check_top_p(body)
    name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    common = _common(body, -1, name)
    top = _integer(body, "top_logprobs", None, 0, TOP_LOGPROBS)
    logprobs = _flag(body, "logprobs")
    if top is not None and not logprobs:
        raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
    settings = Settings([""], echo=False, logprobs=(top or 0) if logprobs else None, **common)
    return [{"role": m["role"], "content": m["content"]} for m in messages], settings


@dataclasses.dataclass(frozen=True)
class EmbeddingSettings:
    """What a /v1/embeddings body asks for, checked: its inputs (texts or ids), the pooling, whether each vector is
    normalised, and whether the vectors come as base64 (OpenAI's little-endian float32 bytes) instead of lists."""

    inputs: list[str | list[int]]
    pooling: str
    normalize: bool
    base64: bool


EMBEDDING_KEYS = {"model", "input", "encoding_format", "dimensions", "user", "pooling", "normalize"}


def embedding_settings(body: Any, vocab: int, dim: int, poolings: tuple[str, ...]) -> EmbeddingSettings:
    """The settings of a /v1/embeddings body: input (a text, a list of ids, or a list of either, as completions'
    prompt), encoding_format float (default) or base64, dimensions only at the model's own (dim), and, as vLLM
    takes them for a decoder model, pooling (one of poolings, default last) and normalize (default true)."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    _unknown(body, EMBEDDING_KEYS)
    if "input" not in body:
        raise APIError("input is required", "input")
    try:
        inputs = _prompts(body["input"], vocab)
    except APIError as e:
        raise APIError(str(e).replace("prompt", "input"), "input") from e
    if any(text == "" for text in inputs):
        raise APIError("an input is empty: every input needs at least one token", "input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise APIError(f"encoding_format must be float or base64, got {encoding!r:.60}", "encoding_format")
    if body.get("dimensions") not in (None, dim):
        raise APIError(f"dimensions can only be this model's {dim} (no shortened embeddings)", "dimensions")
    pooling = body.get("pooling") or "last"
    if pooling not in poolings:
        raise APIError(f"pooling must be one of {', '.join(poolings)}, got {pooling!r:.60}", "pooling")
    normalize = body.get("normalize", True)
    if not isinstance(normalize, bool):
        raise APIError(f"normalize must be true or false, got {normalize!r:.60}", "normalize")
    return EmbeddingSettings(inputs, pooling, normalize, encoding == "base64")


@dataclasses.dataclass(frozen=True)
class TokenizeSettings:
    """A /tokenize body, checked: a text (llama-server's content, vLLM's prompt) or chat messages (vLLM's), whether
    the tokenizer's own special tokens go around a text, and whether each token comes with its piece."""

    text: str | None
    messages: list[dict[str, str]] | None
    add_special: bool
    with_pieces: bool


TOKENIZE_KEYS = {"model", "content", "prompt", "messages", "add_special", "add_special_tokens", "with_pieces"}
TOKENIZE_KEYS |= {"add_generation_prompt"}


def tokenize_settings(body: Any) -> TokenizeSettings:
    """llama-server's {"content", "add_special" (default false), "with_pieces"} or vLLM's {"prompt" or "messages",
    "add_special_tokens" (default true), "add_generation_prompt" (only true: a chat prompt here always ends with
    the assistant's turn)}; special tokens written in a text are parsed either way."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    _unknown(body, TOKENIZE_KEYS)
    given = [key for key in ("content", "prompt", "messages") if key in body]
    if len(given) != 1:
        raise APIError("give one of content (a text), prompt (a text) or messages (a chat)", "content")
    key = given[0]
    if body.get("add_generation_prompt", True) is not True:
        raise APIError("add_generation_prompt can only be true here", "add_generation_prompt")
    with_pieces = _flag(body, "with_pieces")
    if key == "messages":
        messages, _ = chat_settings({"messages": body["messages"]})
        return TokenizeSettings(None, messages, False, with_pieces)
    if not isinstance(body[key], str):
        raise APIError(f"{key} must be a string, got {body[key]!r:.60}", key)
    special = "add_special" if key == "content" else "add_special_tokens"
    other = "add_special_tokens" if key == "content" else "add_special"
    if other in body:
        raise APIError(f"{key} takes {special}, not {other} (llama-server's content, vLLM's prompt)", other)
    add = body.get(special, key == "prompt")
    if not isinstance(add, bool):
        raise APIError(f"{special} must be true or false, got {add!r:.60}", special)
    return TokenizeSettings(body[key], None, add, with_pieces)


def detokenize_ids(body: Any, vocab: int) -> list[int]:
    """A /detokenize body's ids: {"tokens": [ids]} (llama-server's and vLLM's), each inside the vocabulary."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    _unknown(body, {"model", "tokens"})
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(i) for i in tokens):
        raise APIError("tokens must be a list of token ids", "tokens")
    bad = [i for i in tokens if not 0 <= i < vocab]
    if bad:
        raise APIError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "tokens")
    return tokens
