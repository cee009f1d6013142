"""The checkpoint's own tokenizer, through the `tokenizers` library: from a tokenizer.json, or rebuilt from a GGUF
file's metadata (vocabulary, merges, token types, pre-tokenizer) as the byte-level BPE the model was trained with.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from llama_jax.errors import CheckpointError, CorruptFileError, TokenIdError

# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4
# llama.cpp's pre-tokenizer names and the splits that reproduce them
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class Tokenizer:
    """encode(text) → ids and decode(ids) → text, with the special tokens the checkpoint defines."""

    def __init__(self, backend: HFTokenizer):
        self.backend = backend

    @classmethod
    def from_file(cls, path: str | Path) -> Tokenizer:
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # the tokenizers library raises plain Exceptions for every kind of bad file
            raise CorruptFileError(f"{path}: not a valid tokenizer.json ({e})") from e

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], source: str) -> Tokenizer:
        """The byte-level BPE tokenizer of a GGUF file (tokenizer.ggml.model "gpt2")."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise CheckpointError(
                f"{source}: tokenizer.ggml.model is {kind!r}; llama-jax rebuilds byte-level BPE ('gpt2') tokenizers"
                " from GGUF metadata. Use the model's Hugging Face directory (with its tokenizer.json) instead"
            )
        tokens: Sequence[str] = meta.get("tokenizer.ggml.tokens", [])
        merges: Sequence[str] = meta.get("tokenizer.ggml.merges", [])
        types: Sequence[int] = meta.get("tokenizer.ggml.token_type", [1] * len(tokens))
        if not tokens or len(types) != len(tokens) or any(m.count(" ") != 1 for m in merges):
            raise CorruptFileError(f"{source}: the tokenizer metadata (tokens, token types, merges) is malformed")
        vocab = {tok: i for i, tok in enumerate(tokens)}
        bpe = models.BPE(vocab, [tuple(m.split(" ")) for m in merges], fuse_unk=False, byte_fallback=False)
        backend = HFTokenizer(bpe)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre == "smollm":
            backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif pre in ("default", "gpt2", "gpt-2"):
            backend.pre_tokenizer = byte_level
        elif pre in ("llama-bpe", "llama3"):
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
                ]
            )
        else:
            raise CheckpointError(
                f"{source}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer llama-jax knows (smollm, gpt2,"
                " llama-bpe); use the model's Hugging Face directory instead"
            )
        backend.decoder = decoders.ByteLevel()
        added = [
            AddedToken(tok, special=(kind == _CONTROL), normalized=False)
            for tok, kind in zip(tokens, types, strict=True)
            if kind in (_CONTROL, _USER_DEFINED)
        ]
        backend.add_tokens(added)
        bos = meta.get("tokenizer.ggml.bos_token_id")
        if meta.get("tokenizer.ggml.add_bos_token") and bos is not None and 0 <= bos < len(tokens):
            backend.post_processor = processors.TemplateProcessing(
                single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B", special_tokens=[(tokens[bos], bos)]
            )
        return cls(backend)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """The ids of text (special tokens written in it included), with what the checkpoint adds around a text
        (a BOS token for Llama 2/3; nothing for SmolLM2), as transformers' `encode` does by default."""
        return self.backend.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ids, special tokens included."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenIdError(f"token id {bad[0]} is outside the tokenizer's vocabulary [0, {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def save(self, path: str | Path) -> None:
        self.backend.save(str(path))
