"""The family's chat templates render as transformers renders them, and a chat's ids are transformers'
`apply_chat_template` ids: Llama 3.x's header tokens (the templates Meta publishes, from llama.cpp's templates
folder), DeepSeek-R1-Distill-Llama and -Qwen, Mistral Nemo, Qwen2.5, Qwen3 (thinking on and off), SmolLM3 (both
too), Granite 3.3, Phi-3.5-mini, and (tests/data/chat_templates) Llama 2's [INST] with its system block, Mistral
v0.1's, and Zephyr's (TinyLlama-Chat). Each on the tokenizer of its family (llama.cpp's Llama 3, Llama 2, Qwen2 or
Phi-3 vocabulary; Granite's, absent there, on Llama 3's), so that the template's BOS is a token and none is added
twice."""

from __future__ import annotations

from pathlib import Path

import pytest

import llama_jax
from llama_jax.errors import ChatTemplateError
from llama_jax.loaders.checkpoint import Checkpoint
from llama_jax.testing import random_weights, tiny_config
from tests.helpers import llama_cpp_models

pytestmark = pytest.mark.slow

OURS = Path(__file__).parent / "data" / "chat_templates"
# template -> (where it is, the vocabulary of its family)
TEMPLATES = {
    "meta-llama-Llama-3.1-8B-Instruct": ("llama.cpp", "llama-bpe"),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama.cpp", "llama-bpe"),
    "meta-llama-Llama-3.3-70B-Instruct": ("llama.cpp", "llama-bpe"),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": ("llama.cpp", "llama-bpe"),
    "mistralai-Mistral-Nemo-Instruct-2407": ("llama.cpp", "llama-spm"),
    "Qwen-Qwen2.5-7B-Instruct": ("llama.cpp", "qwen2"),
    "Qwen-Qwen3-0.6B": ("llama.cpp", "qwen2"),
    "Qwen-Qwen3-0.6B:no-thinking": ("llama.cpp", "qwen2"),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": ("llama.cpp", "qwen2"),
    "HuggingFaceTB-SmolLM3-3B": ("llama.cpp", "llama-bpe"),
    "HuggingFaceTB-SmolLM3-3B:no-thinking": ("llama.cpp", "llama-bpe"),
    "ibm-granite-granite-3.3-2B-Instruct": ("llama.cpp", "llama-bpe"),
    "microsoft-Phi-3.5-mini-instruct": ("llama.cpp", "phi-3"),
    "llama-2-chat": ("tests", "llama-spm"),
    "mistral-7b-instruct-v0.1": ("tests", "llama-spm"),
    "zephyr-tinyllama-chat": ("tests", "llama-spm"),
}
CONVERSATIONS = {
    "with-system": [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "The capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ],
    "without-system": [{"role": "user", "content": "Hello! Who are you?"}],
}


@pytest.fixture(scope="module")
def models_dir():
    return llama_cpp_models()


@pytest.fixture(scope="module")
def family_models(models_dir):
    """A random tiny model per vocabulary, with that vocabulary's tokenizer (templates are set per test)."""
    models = {}
    for name in ("llama-bpe", "llama-spm", "qwen2", "phi-3"):
        tokenizer = llama_jax.load_tokenizer(models_dir / f"ggml-vocab-{name}.gguf")
        config = tiny_config(vocab=tokenizer.vocab_size, layers=1)
        models[name] = (config, random_weights(config), tokenizer)
    return models


def _template(models_dir, name: str) -> str:
    where, _ = TEMPLATES[name]
    folder = models_dir / "templates" if where == "llama.cpp" else OURS
    return (folder / f"{name.partition(':')[0]}.jinja").read_text(encoding="utf-8")


def _variables(name: str) -> dict[str, bool]:
    """The template's extra variables a name's variant sets (`:no-thinking`: enable_thinking false)."""
    return {"enable_thinking": False} if name.endswith(":no-thinking") else {}


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("name", TEMPLATES)
def test_a_chat_renders_and_tokenizes_as_transformers(models_dir, family_models, name, conversation):
    from transformers import PreTrainedTokenizerFast

    config, weights, tokenizer = family_models[TEMPLATES[name][1]]
    template = _template(models_dir, name)
    eos = tokenizer.special.eos
    model = llama_jax.Model(Checkpoint(config, weights, tokenizer, template, (eos,), name))
    named = {f"{k}_token": tokenizer.token(i) for k, i in tokenizer.special.ids().items() if i is not None}
    hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, chat_template=template, **named)
    messages, variables = CONVERSATIONS[conversation], _variables(name)
    try:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **variables)
    except Exception as refused:  # the template's raise_exception (Mistral v0.1 takes no system message)
        with pytest.raises(ChatTemplateError, match=str(refused).split(":")[-1].strip()[:30]):
            model.chat_prompt(messages, **variables)
        return
    assert model.chat_prompt(messages, **variables) == expected
    ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False, **variables)
    assert model.chat_ids(messages, **variables) == list(ids)
    bos = tokenizer.special.bos
    assert model.chat_ids(messages, **variables)[:2].count(bos) <= 1  # the template's BOS, not a second one
