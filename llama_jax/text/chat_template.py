"""Chat templates: the checkpoint's jinja2 template (tokenizer_config.json or GGUF metadata) rendered as
transformers renders it: a sandboxed environment, trim_blocks and lstrip_blocks, raise_exception and tojson."""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

from llama_jax.errors import ChatTemplateError


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _environment():
    """jinja2's sandbox with transformers' extras (imported here, on the first chat: it costs start-up time)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def render_chat(
    template: str | None,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    **variables: Any,
) -> str:
    """The prompt text of a conversation: messages are {"role": ..., "content": str} dicts, in order."""
    if not template:
        raise ChatTemplateError("this checkpoint has no chat template; use generate with a prompt of your own")
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatTemplateError(f"message {i} is {m!r}; each message is a dict with a string role and content")
    import jinja2

    try:
        compiled = _environment().from_string(template)
        return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template could not be rendered: {e}") from e
