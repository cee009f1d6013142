"""`llama-jax serve`: an OpenAI-compatible HTTP server (`app`) over a continuous-batching engine (`engine`) whose
answers do not depend on the load. Needs the extra: pip install 'llama-jax[serve]' (Starlette and uvicorn)."""

from __future__ import annotations

from pathlib import Path

from llama_jax.errors import MissingExtraError
from llama_jax.model import Model
from llama_jax.serve.prefixes import DEFAULT_BYTES


def run(model: Model, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None, max_batch: int = 8,
        max_context: int = 2048, queue: int = 64, api_key: str | None = None,
        max_body: int | None = None, prompt_cache: int = DEFAULT_BYTES) -> None:  # fmt: skip
    """Serves the model over HTTP until SIGTERM or Ctrl-C (uvicorn then stops accepting, waits for the requests in
    flight, and the engine finishes them). max_body: the largest request body in bytes (None: enough for any one
    prompt of max_context tokens); prompt_cache: the bytes of prefilled prompts kept for reuse (0: none)."""
    try:
        import uvicorn

        from llama_jax.serve.app import Server
    except ImportError as e:
        raise MissingExtraError(
            f"llama-jax serve needs its extra ({e.name} is missing): pip install 'llama-jax[serve]'"
        ) from e
    name = model_name or Path(str(model.checkpoint.source)).name
    server = Server(model, name, max_batch, max_context, queue, api_key, max_body, prompt_cache)
    print(f"llama-jax serve: request bodies up to {server.max_body} bytes (--max-body)", flush=True)
    config = uvicorn.Config(server.app, host=host, port=port, access_log=False, timeout_graceful_shutdown=600)
    uvicorn.Server(config).run()  # logs the address it listens on
