"""A GGUF file's tokenizer rebuilt from its metadata as a `tokenizers` Tokenizer that gives llama.cpp's ids.

Two kinds (tokenizer.ggml.model), the two a Llama-architecture file carries:
- "llama": SentencePiece BPE (Llama 1/2, TinyLlama, CodeLlama, Mistral v0.1-v0.3, Vicuna). The file holds tokens
  and scores but no merges: llama.cpp merges the adjacent pair whose joined text is the token of the highest score,
  so each pair that makes a token becomes a merge ranked by that token's score. A space is "▁", a space is put
  before the text (tokenizer.ggml.add_space_prefix, default true; after a special token too, as llama.cpp does),
  and a character the vocabulary lacks is spelled by its UTF-8 bytes (<0x..> tokens).
- "gpt2": byte-level BPE with the file's merges, cut first by the pre-tokenizer it names
  (`text.pre_tokenizers`).
The BOS / EOS a text gets where the file carries no tokenizer.ggml.add_bos_token / add_eos_token are llama.cpp's
defaults for the vocabulary (`default_flags`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from llama_jax.errors import CheckpointError, CorruptFileError
from llama_jax.text.pre_tokenizers import pre_tokenizer

# GGUF token types (llama.cpp's llama_token_type); the unknown, control and user-defined tokens are matched in a
# text before it is tokenized (the first two as special tokens)
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
_SPACE = "\u2581"  # SentencePiece's "▁"
KINDS = {"llama": "SentencePiece BPE", "gpt2": "byte-level BPE"}


def _kind(meta: Mapping[str, Any], source: str) -> str:
    kind = meta.get("tokenizer.ggml.model")
    if not isinstance(kind, str) or kind not in KINDS:
        held = ", ".join(f"{name!r} ({what})" for name, what in KINDS.items())
        raise CheckpointError(
            f"{source}: tokenizer.ggml.model is {kind!r}; llama-jax rebuilds {held} tokenizers from GGUF metadata."
            " Load the model's Hugging Face directory (with its tokenizer.json) instead"
        )
    return kind


def default_flags(meta: Mapping[str, Any], source: str) -> tuple[bool, bool]:
    """(add BOS, add EOS) where the file does not say: llama.cpp's defaults. SentencePiece adds BOS; byte-level BPE
    adds it for the pre-tokenizers that say so (Llama 3's, tekken); neither adds EOS."""
    if _kind(meta, source) == "llama":
        return True, False
    return pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), source).add_bos, False


def gguf_backend(meta: Mapping[str, Any], source: str) -> HFTokenizer:
    """The tokenizer of a GGUF file's metadata (without the BOS / EOS it adds around a text); CheckpointError for
    a kind llama-jax does not rebuild, CorruptFileError for lists that do not belong together."""
    kind = _kind(meta, source)
    tokens: Sequence[str] = meta.get("tokenizer.ggml.tokens", [])
    types: Sequence[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
    if not tokens or len(types) != len(tokens):
        raise CorruptFileError(f"{source}: the tokenizer metadata (tokens, token types) is malformed")
    backend = _sentencepiece(meta, tokens, source) if kind == "llama" else _byte_level(meta, tokens, source)
    backend.add_tokens(
        [
            AddedToken(token, special=token_type != _USER_DEFINED, normalized=False)
            for token, token_type in zip(tokens, types, strict=True)
            if token_type in (_UNKNOWN, _CONTROL, _USER_DEFINED)
        ]
    )
    return backend


def _sentencepiece(meta: Mapping[str, Any], tokens: Sequence[str], source: str) -> HFTokenizer:
    scores: Sequence[float] = meta.get("tokenizer.ggml.scores", [0.0] * len(tokens))
    if len(scores) != len(tokens):
        raise CorruptFileError(f"{source}: {len(scores)} tokenizer scores for {len(tokens)} tokens")
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None
    backend = HFTokenizer(
        models.BPE(vocab, _merges_by_score(vocab, scores), unk_token=unk_token, fuse_unk=True, byte_fallback=True)
    )
    spaces = [normalizers.Replace(" ", _SPACE)]
    pieces = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if meta.get("tokenizer.ggml.add_space_prefix", True) is not False:
        spaces.insert(0, normalizers.Prepend(_SPACE))
        pieces.append(decoders.Strip(" ", 1, 0))  # the space put before the text
    backend.normalizer = normalizers.Sequence(spaces)
    backend.decoder = decoders.Sequence(pieces)
    return backend


def _merges_by_score(vocab: Mapping[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every pair of tokens whose joined text is a token, the pairs of the higher-scored token first (ties: the
    lower id, then the shorter left part): the order in which llama.cpp's SentencePiece tokenizer merges them."""
    ranked = []
    for token, i in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _byte_level(meta: Mapping[str, Any], tokens: Sequence[str], source: str) -> HFTokenizer:
    pre = pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), source)
    merges: Sequence[str] = meta.get("tokenizer.ggml.merges", [])
    if any(m.count(" ") != 1 for m in merges):
        raise CorruptFileError(f"{source}: a tokenizer merge is not two tokens separated by one space")
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    backend = HFTokenizer(
        models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False, ignore_merges=pre.ignore_merges)
    )
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in pre.splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
    )
    backend.decoder = decoders.ByteLevel()
    return backend
