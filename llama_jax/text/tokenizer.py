"""The checkpoint's own tokenizer, through the `tokenizers` library: from a tokenizer.json, or rebuilt from a GGUF
file's metadata (vocabulary, merges, token types, pre-tokenizer) as the byte-level BPE the model was trained with.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from llama_jax.errors import CheckpointError, ConfigError, CorruptFileError, TokenIdError

# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4
# the named special tokens: SpecialTokens' field -> its GGUF key (tokenizer.ggml.<key>); tokenizer_config.json
# names each "<field>_token"
_SPECIAL_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}
# llama.cpp's pre-tokenizer names and the splits that reproduce them
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """The tokenizer's named special tokens by id (None where the checkpoint names none) and whether encoding a text
    adds BOS before it and EOS after it: what transformers' tokenizer reads from tokenizer_config.json, or from a
    GGUF file's tokenizer.ggml.{bos,eos,unknown,padding}_token_id and add_bos_token / add_eos_token."""

    bos: int | None = None
    eos: int | None = None
    unk: int | None = None
    pad: int | None = None
    add_bos: bool = False
    add_eos: bool = False

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], source: str) -> SpecialTokens:
        """The ones a GGUF file's metadata names; ConfigError for an id or flag of the wrong type."""
        ids = {name: _gguf_value(meta, f"tokenizer.ggml.{key}", int, source) for name, key in _SPECIAL_KEYS.items()}
        flags = {
            flag: _gguf_value(meta, f"tokenizer.ggml.{flag}_token", bool, source) for flag in ("add_bos", "add_eos")
        }
        return cls(**ids, **{flag: bool(value) for flag, value in flags.items()})

    @classmethod
    def from_tokenizer_config(cls, tok_config: Mapping[str, Any], tokenizer: Tokenizer, source: str) -> SpecialTokens:
        """The ones tokenizer_config.json names (a token's text, or {"content": text, ...}), as ids of tokenizer;
        CheckpointError for a token the vocabulary lacks."""
        ids = {}
        for name in _SPECIAL_KEYS:
            token = tok_config.get(f"{name}_token")
            token = token.get("content") if isinstance(token, Mapping) else token
            ids[name] = None if not isinstance(token, str) else tokenizer.token_id(token)
            if isinstance(token, str) and ids[name] is None:
                raise CheckpointError(f"{source}: {name}_token {token!r} is not a token of the tokenizer")
        return cls(
            **ids, add_bos=tok_config.get("add_bos_token") is True, add_eos=tok_config.get("add_eos_token") is True
        )

    def ids(self) -> dict[str, int | None]:
        """{"bos": id or None, "eos": ..., "unk": ..., "pad": ...}."""
        return {name: getattr(self, name) for name in _SPECIAL_KEYS}

    def tokenizer_config(self, tokenizer: Tokenizer) -> dict[str, Any]:
        """These as tokenizer_config.json's entries (token texts; None where there is none), which transformers'
        tokenizer and special_tokens_map.json read."""
        tokens = {f"{name}_token": tokenizer.token(i) for name, i in self.ids().items()}
        return tokens | {"add_bos_token": self.add_bos, "add_eos_token": self.add_eos}


def _gguf_value(meta: Mapping[str, Any], key: str, kind: type, source: str) -> Any:
    value = meta.get(key)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise ConfigError(f"{source}: {key} is {value!r}; expected {'a token id' if kind is int else 'true or false'}")
    return value


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
    def from_gguf(cls, meta: Mapping[str, Any], source: str, special: SpecialTokens | None = None) -> Tokenizer:
        """The byte-level BPE tokenizer of a GGUF file (tokenizer.ggml.model "gpt2"); special: its special tokens,
        if already read (`SpecialTokens.from_gguf`), for the BOS / EOS it adds around a text."""
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
        special = SpecialTokens.from_gguf(meta, source) if special is None else special
        bos = tokens[special.bos] if special.add_bos and special.bos is not None and special.bos < len(tokens) else None
        eos = tokens[special.eos] if special.add_eos and special.eos is not None and special.eos < len(tokens) else None
        if bos or eos:  # transformers' template for these flags (TokenizersBackend.update_post_processor)
            single = f"{f'{bos}:0 ' if bos else ''}$A:0{f' {eos}:0' if eos else ''}"
            pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
            ids = [(bos, special.bos)] * bool(bos) + [(eos, special.eos)] * bool(eos)
            backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)
        return cls(backend)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """An upper bound on the bytes of text (so on its characters) that one token covers: the UTF-8 length of the
        longest token as the vocabulary writes it (byte-level BPE writes a byte as one character of 1-2 bytes,
        SentencePiece a space as '▁', a byte fallback as '<0xAB>', a special token as its text). A text of more
        characters than this times N has more than N tokens, which is known without tokenizing it."""
        return max(len(token.encode()) for token in self.backend.get_vocab(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        """The ids of text (special tokens written in it included), with what the checkpoint adds around a text
        (a BOS token for Llama 2/3; nothing for SmolLM2), as transformers' `encode` does by default."""
        return self.backend.encode(text).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of ids, special tokens included (skip_special: left out, as lm-eval reads a generation)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenIdError(f"token id {bad[0]} is outside the tokenizer's vocabulary [0, {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def token_id(self, token: str) -> int | None:
        """The id of a token's text, None if the vocabulary lacks it."""
        return self.backend.token_to_id(token)

    def token(self, token_id: int | None) -> str | None:
        """The text of one token (None for None)."""
        return None if token_id is None else self.backend.id_to_token(token_id)

    def save(self, path: str | Path) -> None:
        self.backend.save(str(path))
