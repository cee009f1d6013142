"""The tokenizer rebuilt from the GGUF metadata equals transformers' own GGUF tokenizer on the default model,
and text survives encode → decode."""

from __future__ import annotations

import pytest

TEXTS = [
    "Hello world",
    "The year 2024 had 366 days; π ≈ 3.14159265 and 1,000,000 is a million.",
    "  leading spaces,\ttabs,\n\nnewlines and   runs of   spaces  ",
    "def f(x):\n    return x ** 2  # square\n",
    "Café, naïve, Zürich, São Paulo, Ελληνικά, Русский, 中文字符, 日本語のテキスト",
    "emoji 🙂🚀👩‍👩‍👧 and symbols ©®™ — “quotes” ‘single’ …",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end<repo_name>name<file_sep>",
    "don't won't it's we're they've I'm you'll he'd",
    "",
]


@pytest.fixture(scope="module")
def hf_tokenizer(default_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_path.parent), gguf_file=default_path.name)


@pytest.mark.slow
@pytest.mark.parametrize("text", TEXTS)
def test_gguf_tokenizer_equals_transformers(model, hf_tokenizer, text):
    assert model.tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_of_encode_is_the_text(model, text):
    assert model.tokenizer.decode(model.tokenizer.encode(text)) == text


def test_special_tokens_are_single_ids(model):
    """The chat markers are the checkpoint's special tokens, one id each, never split into pieces."""
    tok = model.tokenizer
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert model.eos_ids == (2,)
