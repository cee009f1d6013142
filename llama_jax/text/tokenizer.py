"""The checkpoint's own tokenizer, through the `tokenizers` library: from a tokenizer.json, or rebuilt from a GGUF
file's metadata (`text.gguf_vocab`), with the special tokens the checkpoint names.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

from llama_jax.errors import CheckpointError, ConfigError, CorruptFileError, TokenIdError
from llama_jax.text.gguf_vocab import default_flags, gguf_backend

# the named special tokens: SpecialTokens' field -> its GGUF key (tokenizer.ggml.<key>); tokenizer_config.json
# names each "<field>_token"
_SPECIAL_KEYS = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "pad": "padding_token_id"}


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """The tokenizer's named special tokens by id (None where the checkpoint names none) and whether encoding a text
    adds BOS before it and EOS after it: what transformers' tokenizer reads from tokenizer_config.json, or from a
    GGUF file's tokenizer.ggml.{bos,eos,unknown,padding}_token_id and add_bos_token / add_eos_token (where it has no
    flag, llama.cpp's default for its vocabulary)."""

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
        defaults = dict(zip(("add_bos", "add_eos"), default_flags(meta, source), strict=True))
        flags = {flag: _gguf_value(meta, f"tokenizer.ggml.{flag}_token", bool, source) for flag in defaults}
        return cls(**ids, **{flag: defaults[flag] if value is None else value for flag, value in flags.items()})

    @classmethod
    def from_tokenizer_config(cls, tok_config: Mapping[str, Any], backend: HFTokenizer, source: str) -> SpecialTokens:
        """The ones tokenizer_config.json names (a token's text, or {"content": text, ...}), as ids of tokenizer;
        CheckpointError for a token the vocabulary lacks."""
        ids = {}
        for name in _SPECIAL_KEYS:
            token = tok_config.get(f"{name}_token")
            token = token.get("content") if isinstance(token, Mapping) else token
            ids[name] = None if not isinstance(token, str) else backend.token_to_id(token)
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


def _byte_of_character() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: the character a byte-level BPE vocabulary writes for each byte (the
    printable bytes as themselves, the others as the characters from U+0100 on, in byte order) -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


_BYTE_OF_CHARACTER = _byte_of_character()


def _gguf_value(meta: Mapping[str, Any], key: str, kind: type, source: str) -> Any:
    value = meta.get(key)
    if value is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
        raise ConfigError(f"{source}: {key} is {value!r}; expected {'a token id' if kind is int else 'true or false'}")
    return value


class Tokenizer:
    """encode(text) → ids and decode(ids) → text, with the special tokens the checkpoint defines (`special`: their
    ids, and whether a text gets BOS / EOS)."""

    def __init__(self, backend: HFTokenizer, special: SpecialTokens | None = None):
        self.backend = backend
        self.special = SpecialTokens() if special is None else special

    @classmethod
    def from_files(
        cls, tokenizer_json: str | Path, tokenizer_config: Mapping[str, Any], config_source: str
    ) -> Tokenizer:
        """A Hugging Face directory's tokenizer: tokenizer.json, with the special tokens tokenizer_config.json
        (read as tokenizer_config, from config_source) names; CorruptFileError for an unreadable tokenizer.json."""
        try:
            backend = HFTokenizer.from_file(str(tokenizer_json))
        except Exception as e:  # the tokenizers library raises plain Exceptions for every kind of bad file
            raise CorruptFileError(f"{tokenizer_json}: not a valid tokenizer.json ({e})") from e
        return cls(backend, SpecialTokens.from_tokenizer_config(tokenizer_config, backend, config_source))

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], source: str) -> Tokenizer:
        """A GGUF file's tokenizer (`text.gguf_vocab`), adding the BOS / EOS around a text that the file says, or
        llama.cpp's default for its vocabulary where it does not."""
        special = SpecialTokens.from_gguf(meta, source)
        backend = gguf_backend(meta, source)
        tokens = meta["tokenizer.ggml.tokens"]
        bos = tokens[special.bos] if special.add_bos and special.bos is not None and special.bos < len(tokens) else None
        eos = tokens[special.eos] if special.add_eos and special.eos is not None and special.eos < len(tokens) else None
        if bos or eos:  # transformers' template for these flags (TokenizersBackend.update_post_processor)
            single = f"{f'{bos}:0 ' if bos else ''}$A:0{f' {eos}:0' if eos else ''}"
            pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
            ids = [(bos, special.bos)] * bool(bos) + [(eos, special.eos)] * bool(eos)
            backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=ids)
        return cls(backend, special)

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

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """The ids of text (special tokens written in it included), with what the checkpoint adds around a text
        (a BOS token for Llama 2/3; nothing for SmolLM2), as transformers' `encode` does by default; add_special
        False: the text's own tokens only (a chat template's output, which writes its BOS itself)."""
        return self.backend.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of ids, special tokens included (skip_special: left out, as lm-eval reads a generation)."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise TokenIdError(f"token id {bad[0]} is outside the tokenizer's vocabulary [0, {self.vocab_size})")
        return self.backend.decode(ids, skip_special_tokens=skip_special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text one token stands for, as llama.cpp's token_to_piece gives them: an added (special)
        token's text; a byte-level BPE token's bytes (GPT-2's map of bytes to characters undone); a SentencePiece
        token's text with its replacements undone ('▁' a space), a byte token <0xAB> its byte. A token may hold part
        of a character: the pieces of a text's tokens join to its bytes (a SentencePiece vocabulary's leading space
        included)."""
        self.decode([token_id])  # TokenIdError outside the vocabulary
        token = self.backend.id_to_token(token_id)
        if token_id in self._added_ids:
            return token.encode()
        byte_level, fallback, replacements = self._piece_rules
        if byte_level:
            return bytes(_BYTE_OF_CHARACTER[c] for c in token)
        if fallback and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
            return bytes([int(token[3:5], 16)])
        for pattern, content in replacements:
            token = token.replace(pattern, content)
        return token.encode()

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    @functools.cached_property
    def _piece_rules(self) -> tuple[bool, bool, tuple[tuple[str, str], ...]]:
        """What the tokenizer's decoder does to a token: (byte-level, byte fallback, its string replacements)."""
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        parts = decoder.get("decoders", []) if decoder.get("type") == "Sequence" else [decoder]
        kinds = {part.get("type") for part in parts}
        replacements = tuple(
            (part["pattern"]["String"], part["content"])
            for part in parts
            if part.get("type") == "Replace" and "String" in part.get("pattern", {})
        )
        return "ByteLevel" in kinds, "ByteFallback" in kinds, replacements

    def token_id(self, token: str) -> int | None:
        """The id of a token's text, None if the vocabulary lacks it."""
        return self.backend.token_to_id(token)

    def token(self, token_id: int | None) -> str | None:
        """The text of one token (None for None)."""
        return None if token_id is None else self.backend.id_to_token(token_id)

    def save(self, path: str | Path) -> None:
        self.backend.save(str(path))
