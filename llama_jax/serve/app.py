"""The HTTP server: the OpenAI API's completions, chat completions, embeddings, models and health endpoints, and
llama-server's and vLLM's /tokenize and /detokenize, on Starlette (an ASGI toolkit: routing, requests and streaming
responses, nothing else to configure), served by uvicorn.

Every request is checked (`protocol`) before it reaches the engine, and answered in the bodies `responses` builds;
a bad one is a 400 in the OpenAI error shape, an unknown route a 404, a missing or wrong API key a 401, a body past
--max-body a 413 (before it is read whole), a full queue a 429 with Retry-After. Parsing, the chat template and the
tokenizer run in one preprocessing thread, requests in arrival order: never on the event loop, so no request's
preprocessing delays /health or another's tokens (one thread: a tokenizer is not shared between threads that
encode). Streaming answers are server-sent events ("data: {chunk}", then "data: [DONE]"). A client that goes away
cancels its request: its slot is free at the next chunk.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llama_jax.errors import APIError, EngineStoppedError, GrammarError, LlamaJaxError, QueueFullError
from llama_jax.model import POOLINGS, Model
from llama_jax.passes.sampling import Sampling
from llama_jax.serve import responses
from llama_jax.serve.engine import Engine, Finished, PromptLogprobs, Request, Token
from llama_jax.serve.prefixes import DEFAULT_BYTES
from llama_jax.serve.protocol import (
    Settings,
    body_limit,
    chat_settings,
    completion_settings,
    detokenize_ids,
    embedding_settings,
    parse_json,
    tokenize_settings,
)
from llama_jax.text.grammar import Guide

RETRY_AFTER = "1"  # seconds, with a 429
TRIM_AFTER = 1 << 20  # bytes: a body larger than this has its memory handed back to the system once it is parsed


@functools.cache
def _malloc_trim():
    return getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None elsewhere (musl, macOS)


def _trim_heap() -> None:
    """Hands the C heap's free pages back to the system. A large body's pieces (the socket's reads, the joined bytes,
    the parsed text) are freed into glibc's arenas, which keep them: without this a refused 64 MB body left the
    process ~100 MB larger for good."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _error(e: APIError) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER} if e.status == 429 else {}
    if e.status == 413:  # the connection closes after the answer: the rest of the body is never read
        headers["Connection"] = "close"
    return JSONResponse(responses.error(e), status_code=e.status, headers=headers)


def _event(body: dict) -> str:
    """A server-sent event of a JSON body."""
    return f"data: {json.dumps(body)}\n\n"


class Server:
    """The app of one model: `app` (ASGI), the engine started and stopped with it. model_name: the id /v1/models
    lists and requests may name; api_key: required as a bearer token on every endpoint but /health; max_body: the
    largest request body in bytes (None: `protocol.body_limit`, enough for any one prompt the context holds);
    prompt_cache: the bytes of prefilled prompts the engine keeps for reuse (0: none)."""

    def __init__(self, model: Model, model_name: str, max_batch: int = 8, capacity: int = 2048,
                 queue: int = 64, api_key: str | None = None, max_body: int | None = None,
                 prompt_cache: int = DEFAULT_BYTES):  # fmt: skip
        self.model, self.model_name, self.api_key = model, model_name, api_key
        self.capacity = min(capacity, model.config.context)
        self.max_body = body_limit(self.capacity, model.tokenizer.longest_token_bytes) if max_body is None else max_body
        self.prep = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llama-jax-prep")
        # embeddings: forward passes of their own (no decode slot), one request at a time beside the engine's
        self.embedder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llama-jax-embed")
        self.embedding_requests = 0  # admitted and not answered (the event loop's count: no lock)
        self.engine = Engine(model, max_batch, self.capacity, queue, prompt_cache)
        self.created = int(time.time())
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
        ]
        self.app = Starlette(routes=routes, lifespan=self._lifespan, exception_handlers={404: self._not_found})
        self.app.add_middleware(_Auth, key=api_key)

    @contextlib.asynccontextmanager
    async def _lifespan(self, _app):
        thread = threading.Thread(target=self.engine.run, name="llama-jax-engine", daemon=True)
        thread.start()
        yield
        self.engine.stop()  # the requests in flight finish first (uvicorn waits for their connections)
        await asyncio.to_thread(thread.join)
        self.prep.shutdown()
        self.embedder.shutdown()

    async def _not_found(self, request: HttpRequest, _exc) -> JSONResponse:
        return _error(APIError(f"no route {request.method} {request.url.path}", status=404, code="not_found"))

    async def health(self, _request: HttpRequest) -> JSONResponse:
        if self.engine.failed:
            return JSONResponse({"status": "error", "error": self.engine.failed}, status_code=503)
        return JSONResponse({"status": "ok", "busy": self.engine.busy, "prompt_cache": self.engine.prompts.stats()})

    async def models(self, _request: HttpRequest) -> JSONResponse:
        return JSONResponse(responses.models(self.model_name, self.created))

    async def completions(self, request: HttpRequest) -> Response:
        return await self._serve(request, self._completion, chat=False)

    async def chat(self, request: HttpRequest) -> Response:
        return await self._serve(request, self._chat, chat=True)

    async def embeddings(self, request: HttpRequest) -> Response:
        """Refused (429) while as many embedding requests wait as the engine queues generations."""
        if self.embedding_requests >= self.engine.queue_size:
            return _error(
                APIError(
                    f"too many requests: {self.embedding_requests} embedding requests are waiting; retry later",
                    status=429, code="rate_limit_exceeded",
                )
            )  # fmt: skip
        self.embedding_requests += 1
        try:
            return await self._whole(request, self._embeddings, self.embedder)
        finally:
            self.embedding_requests -= 1

    async def tokenize(self, request: HttpRequest) -> Response:
        return await self._whole(request, self._tokenize, self.prep)

    async def detokenize(self, request: HttpRequest) -> Response:
        return await self._whole(request, self._detokenize, self.prep)

    async def _whole(self, request: HttpRequest, work, executor: concurrent.futures.Executor) -> Response:
        """A request answered in one body, work(raw body) -> the body, run off the event loop on executor."""
        try:
            raw = await self._read(request)
            return JSONResponse(await asyncio.get_running_loop().run_in_executor(executor, work, raw))
        except APIError as e:
            return _error(e)
        except ClientDisconnect:
            return Response(status_code=499)

    async def _serve(self, request: HttpRequest, prepare, chat: bool) -> Response:
        """Reads the body (bounded), prepares it in the preprocessing thread (checks, chat template, tokenizer),
        then runs it."""
        try:
            loop = asyncio.get_running_loop()
            raw = await self._read(request)
            size = len(raw)
            try:
                prompts, settings, guide = await loop.run_in_executor(self.prep, prepare, raw)
            finally:
                del raw
                if size > TRIM_AFTER:
                    await loop.run_in_executor(self.prep, _trim_heap)
            return await self._answer(request, prompts, settings, guide, chat)
        except APIError as e:
            return _error(e)
        except ClientDisconnect:
            return Response(status_code=499)  # the client left while sending: nobody reads this

    async def _read(self, request: HttpRequest) -> bytes:
        """The body, refused (413) as soon as it is known to be past max_body: by its Content-Length before any of
        it is read, or while it streams in (a chunked body is cut off there)."""
        declared = request.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > self.max_body:
            raise self._too_large(f"is {int(declared)} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise self._too_large(f"has more than {self.max_body} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _too_large(self, what: str) -> APIError:
        return APIError(
            f"the request body {what}; this server takes at most {self.max_body} bytes (enough for a prompt of"
            f" {self.capacity} tokens): shorten the prompt, or start the server with a larger --max-body",
            status=413, code="request_too_large",
        )  # fmt: skip

    # the preprocessing thread's work: parse, check, render, tokenize

    def _json(self, raw: bytes) -> Any:
        body = parse_json(raw)
        if isinstance(body, dict) and "model" in body and not isinstance(body["model"], str | None):
            raise APIError(f"model must be a string, got {body['model']!r}", "model")
        if isinstance(body, dict) and body.get("model") not in (None, self.model_name):
            raise APIError(
                f"model {body['model']!r} is not served here; this server serves {self.model_name!r}",
                "model", status=404, code="model_not_found",
            )  # fmt: skip
        return body

    def _completion(self, raw: bytes) -> tuple[list[list[int]], Settings, Guide | None]:
        settings = completion_settings(self._json(raw), self.model.config.vocab)
        self._check_choices(settings)
        return [self._encode(p, settings.max_tokens) for p in settings.prompts], settings, self._guide(settings)

    def _chat(self, raw: bytes) -> tuple[list[list[int]], Settings, Guide | None]:
        messages, settings = chat_settings(self._json(raw))
        self._check_choices(settings)
        try:
            prompt = self.model.chat_prompt(messages)
        except LlamaJaxError as e:
            raise APIError(str(e), "messages") from e
        ids = self._encode(prompt, max(settings.max_tokens, 1), chat=True)  # at least one new token
        if settings.max_tokens < 0:  # not given: the room left in the context
            settings = dataclasses.replace(settings, max_tokens=self.capacity - len(ids))
        return [ids], settings, self._guide(settings)

    def _guide(self, s: Settings) -> Guide | None:
        """The matcher of the request's grammar over the model's vocabulary, which each choice forks (None without
        a grammar); a grammar that does not compile against the vocabulary is a 400."""
        if s.grammar is None:
            return None
        try:
            return self.model.guide(s.grammar)
        except GrammarError as e:
            raise APIError(str(e), s.grammar_field) from e

    def _embeddings(self, raw: bytes) -> dict:
        config = self.model.config
        s = embedding_settings(self._json(raw), config.vocab, config.dim, POOLINGS)
        inputs = [self._encode(text, 0) for text in s.inputs]
        vectors = self.model.embed(inputs, s.pooling, s.normalize)
        return responses.embeddings(self.model_name, list(vectors), s.base64, sum(len(ids) for ids in inputs))

    def _tokenize(self, raw: bytes) -> dict:
        s, tokenizer = tokenize_settings(self._json(raw)), self.model.tokenizer
        try:
            ids = tokenizer.encode(s.text, s.add_special) if s.messages is None else self.model.chat_ids(s.messages)
        except LlamaJaxError as e:
            raise APIError(str(e), "messages") from e
        pieces = [tokenizer.token_bytes(i) for i in ids] if s.with_pieces else None
        return responses.tokens(ids, pieces, self.capacity)

    def _detokenize(self, raw: bytes) -> dict:
        ids = detokenize_ids(self._json(raw), self.model.tokenizer.vocab_size)
        return responses.text(self.model.tokenizer.decode(ids))

    def _check_choices(self, s: Settings) -> None:
        """A request of more choices (prompts × n) than the queue holds could never be admitted: refused before any
        of its prompts is tokenized."""
        if len(s.prompts) * s.n > self.engine.queue_size:
            raise APIError(
                f"the request asks for {len(s.prompts) * s.n} choices ({len(s.prompts)} prompts, n {s.n}) and this"
                f" server queues at most {self.engine.queue_size}: send fewer prompts or a smaller n",
                "n" if s.n > 1 else "prompt",
            )  # fmt: skip

    def _encode(self, prompt: str | list[int], max_tokens: int, chat: bool = False) -> list[int]:
        """A prompt's ids, checked to fit with max_tokens new ones. A text too long to fit is refused by its length
        in characters before it is tokenized (a token covers at most longest_token_bytes of them). chat: a
        rendered chat prompt, tokenized as `Model.chat_ids` does (nothing added around it)."""
        if isinstance(prompt, str):
            fewest = -(-len(prompt) // self.model.tokenizer.longest_token_bytes)
            self._check_room(fewest, max_tokens, f"at least {fewest} tokens (its {len(prompt)} characters)")
            prompt = self.model.tokenizer.encode(prompt, add_special=not chat)
        if not prompt:
            raise APIError("the prompt has no tokens", "prompt")
        self._check_room(len(prompt), max_tokens, f"{len(prompt)} tokens")
        return prompt

    def _check_room(self, tokens: int, max_tokens: int, has: str) -> None:
        if tokens + max_tokens > self.capacity:
            raise APIError(
                f"this server's context is {self.capacity} tokens; the prompt has {has} and max_tokens is"
                f" {max_tokens} ({tokens + max_tokens} in all): shorten the prompt or lower max_tokens",
                "max_tokens", code="context_length_exceeded",
            )  # fmt: skip

    async def _answer(
        self, http: HttpRequest, prompts: list[list[int]], s: Settings, guide: Guide | None, chat: bool
    ) -> Response:
        """Submits every choice (prompt i, sample j with the body's seed + j; each its own fork of the grammar's
        guide), then streams or gathers their events."""
        loop = asyncio.get_running_loop()
        queues, requests = [], []
        for ids in prompts:
            for j in range(s.n):
                queue: asyncio.Queue = asyncio.Queue()
                sampling = Sampling(s.temperature, s.top_k, s.top_p, s.seeds[j], s.stop, s.grammar)
                emit = (lambda q: lambda event: loop.call_soon_threadsafe(q.put_nowait, event))(queue)
                wants_prompt = s.echo and s.logprobs is not None
                fork = None if guide is None else guide.fork()
                requests.append(
                    Request(ids, s.max_tokens, sampling, emit, s.logprobs, wants_prompt, fork, s.cache_prompt)
                )
                queues.append(queue)
        try:
            self.engine.submit(*requests)
        except QueueFullError as e:
            return _error(APIError(f"too many requests: {e}; retry later", status=429, code="rate_limit_exceeded"))
        except EngineStoppedError as e:
            return _error(APIError(f"not taking requests: {e}", status=503, code="unavailable"))
        reply = _Reply(self, prompts, s, chat)
        if s.stream:
            return StreamingResponse(reply.stream(http, queues, requests), media_type="text/event-stream")
        return await reply.whole(http, queues, requests)


class _Reply:
    """One request's answer, whole or as server-sent events: gathers or streams its choices' events into the bodies
    `responses` builds."""

    def __init__(self, server: Server, prompts: list[list[int]], settings: Settings, chat: bool):
        self.prompts, self.s = prompts, settings
        kind = "chatcmpl" if chat else "cmpl"
        self.head = responses.Head(f"{kind}-{uuid.uuid4().hex}", int(time.time()), server.model_name, chat)
        self.decode = server.model.tokenizer.decode

    def _prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.s.n]

    def _token_text(self, i: int) -> str:
        return self.decode([i])

    async def _events(self, http: HttpRequest, queue: asyncio.Queue, request: Request):
        """The events of one choice as they come; cancels it if the client goes away (checked every half second,
        events coming or not)."""
        checked = time.monotonic()
        while True:
            try:
                event = await asyncio.wait_for(queue.get(), timeout=0.5)
            except TimeoutError:
                event = None
            if time.monotonic() - checked >= 0.5:
                checked = time.monotonic()
                if await http.is_disconnected():
                    request.cancel()
                    return
            if event is None:
                continue
            yield event
            if isinstance(event, Finished):
                return

    async def whole(self, http: HttpRequest, queues, requests) -> Response:
        async def gather(k: int):
            texts, tokens, prompt, reason = [], [], None, None
            async for event in self._events(http, queues[k], requests[k]):
                if isinstance(event, PromptLogprobs):
                    prompt = event
                elif isinstance(event, Token):
                    tokens.append(event)
                    texts.append(event.text)
                else:
                    texts.append(event.text)
                    reason = event.reason
            return texts, tokens, prompt, reason

        try:
            results = await asyncio.gather(*(gather(k) for k in range(len(queues))))
        finally:
            for r in requests:  # a request already finished ignores it
                r.cancel()
        if any(reason in (None, "cancelled") for *_, reason in results):
            return Response(status_code=499)  # the client went away: nobody reads this
        failed = [texts[-1] for texts, _, _, reason in results if reason == "error"]
        if failed:
            return _error(APIError(f"the engine failed: {failed[0]}", status=500, code="server_error"))
        chat, choices = self.head.chat, []
        for k, (texts, tokens, prompt, reason) in enumerate(results):
            text = "".join(texts)
            if self.s.echo:
                text = self.decode(self._prompt_of(k)) + text
            logprobs = None
            if self.s.logprobs is not None:
                logprobs = responses.choice_logprobs(chat, tokens, self._token_text, self._prompt_of(k), prompt)
            choices.append(responses.choice(chat, k, text, reason, logprobs))
        usage = responses.token_usage(self.prompts, [len(r[1]) for r in results])
        return JSONResponse(responses.completion(self.head, choices, usage))

    def _chunk(self, pieces: list[dict], usage: dict | None = None) -> str:
        return _event(responses.chunk(self.head, pieces, usage))

    async def stream(self, http: HttpRequest, queues, requests) -> AsyncIterator[str]:
        """Server-sent events: (chat: each choice's role first; echo: each choice's prompt first, with its
        log-probabilities where asked), a chunk per new token, a last chunk per choice with its finish reason,
        the usage where asked, then [DONE]."""
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(k: int):
            async for event in self._events(http, queues[k], requests[k]):
                await merged.put((k, event))
            await merged.put((k, None))

        tasks = [asyncio.create_task(pump(k)) for k in range(len(queues))]
        chat, made, open_ = self.head.chat, [0] * len(queues), len(queues)
        try:
            for k in range(len(queues)):
                if chat:
                    yield self._chunk([responses.chat_role(k)])
                elif self.s.echo and self.s.logprobs is None:  # (with logprobs: when the prompt's are scored)
                    yield self._chunk([responses.piece(chat, k, self.decode(self._prompt_of(k)), None, None)])
            while open_:
                k, event = await merged.get()
                if event is None:
                    open_ -= 1
                elif isinstance(event, PromptLogprobs):
                    ids = self._prompt_of(k)
                    entries = responses.prompt_logprobs(ids, event, self._token_text)
                    yield self._chunk([responses.piece(chat, k, self.decode(ids), None, entries)])
                elif isinstance(event, Token):
                    made[k] += 1
                    asked = self.s.logprobs is not None
                    entries = responses.token_logprobs(chat, [event], self._token_text) if asked else None
                    yield self._chunk([responses.piece(chat, k, event.text, None, entries)])
                elif event.reason == "error":
                    yield _event(responses.error(APIError(event.text, status=500, code="server_error")))
                    return
                elif event.reason != "cancelled":
                    yield self._chunk([responses.piece(chat, k, event.text, event.reason, None)])
            if self.s.include_usage:
                yield self._chunk([], responses.token_usage(self.prompts, made))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            for r in requests:
                r.cancel()


class _Auth:
    """With a key: every endpoint but /health needs `Authorization: Bearer KEY` (401 otherwise)."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        if not hmac.compare_digest(given, f"Bearer {self.key}".encode()):
            error = APIError("a valid API key is required: Authorization: Bearer KEY", status=401,
                             code="invalid_api_key")  # fmt: skip
            return await _error(error)(scope, receive, send)
        return await self.app(scope, receive, send)
