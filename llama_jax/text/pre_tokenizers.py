"""llama.cpp's byte-level BPE pre-tokenizers, by the name a GGUF file gives in `tokenizer.ggml.pre`.

A pre-tokenizer cuts a text into pieces before BPE merges within each: each split pattern in turn cuts every piece
further, its matches and the text between them both kept (llama.cpp's `unicode_regex_split`; the tokenizers
library's `Split(behavior="isolated")`). The patterns are those of the models' own tokenizer.json files, as
llama.cpp's `llm_tokenizer_bpe` lists them (its comments give the original where it rewrote one for its own regex
engine; the tokenizers library runs the original). Names with the same patterns and flags share a row, as in
llama.cpp. Checked against llama.cpp's vocabulary test vectors (tests/test_gguf_tokenizers.py) for each row that
has a vocabulary file there.
"""

from __future__ import annotations

import dataclasses

from llama_jax.errors import CheckpointError


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
    """splits: the patterns, applied in order; ignore_merges: a piece that is itself a token is that token (Llama
    3's BPE); add_bos: llama.cpp's default for whether a text gets BOS, where the file carries no
    tokenizer.ggml.add_bos_token."""

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


# the patterns (Python strings of Oniguruma syntax, which the tokenizers library compiles)
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# a word: capitals then lower case (Mistral's tekken, GPT-4o)
_CASED = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+{s}"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*{s}"
)
_TEKKEN = _CASED.replace("{s}", "") + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = (
    _CASED.replace("{s}", r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?")
    + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SEED_CODER = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# deepseek-llm's letters: the cased letters of Unicode, listed
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)

_DEEPSEEK_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"

# one row per pattern list and flags: (the names llama.cpp reads it for, the pre-tokenizer)
_ROWS: tuple[tuple[tuple[str, ...], PreTokenizer], ...] = (
    (("default",), PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"))),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True),
    ),
    (("smaug-bpe", "dbrx"), PreTokenizer((_LLAMA3,))),
    (("deepseek-llm",), PreTokenizer(("[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCT, r"\s+$", _CJK, r"\p{N}+"))),
    (("deepseek-coder",), PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"))),
    (("falcon",), PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"))),
    (
        ("gpt-2", "phi-2", "mpt", "olmo", "jais", "gigachat", "a.x-4.0", "mellum", "exaone4", "trillion"),
        PreTokenizer((_GPT2,)),
    ),
    (
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
        PreTokenizer((r"\p{N}", _GPT2)),
    ),
    (
        ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan", "solar-open", "grok-2", "kormo", "f2llmv2"),
        PreTokenizer((_QWEN2,)),
    ),
    (("qwen35",), PreTokenizer((_QWEN35,))),
    (("tekken",), PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True)),
    (("gpt-4o", "llama4", "kanana2", "talkie"), PreTokenizer((_GPT4O,))),
    (("seed-coder",), PreTokenizer((_SEED_CODER,))),
    (("poro-chat", "bloom", "gpt3-finnish"), PreTokenizer((_BLOOM,))),
    (("viking",), PreTokenizer((_BLOOM, r"\p{N}"))),
)
PRE_TOKENIZERS: dict[str, PreTokenizer] = {name: pre for names, pre in _ROWS for name in names}


def pre_tokenizer(name: object, source: str) -> PreTokenizer:
    """The pre-tokenizer of tokenizer.ggml.pre `name`; CheckpointError for one llama-jax does not hold."""
    if not isinstance(name, str) or name not in PRE_TOKENIZERS:
        raise CheckpointError(
            f"{source}: tokenizer.ggml.pre {name!r} is not a byte-level pre-tokenizer llama-jax holds (it holds"
            f" {', '.join(sorted(PRE_TOKENIZERS))}); load the model's Hugging Face directory (its tokenizer.json)"
            " instead"
        )
    return PRE_TOKENIZERS[name]
