"""Constrained decoding's grammars: what a generation's text must match (a JSON schema, any JSON object, a GBNF or
Lark grammar, a regular expression), compiled by llguidance against the model's vocabulary into a mask of the
tokens allowed next.

A `Grammar` is a value, checked when made and independent of any model (llguidance's grammar definition). A
`Vocabulary` is llguidance's view of a tokenizer: each id's bytes (`Tokenizer.token_bytes`) and the ids that end a
text. A `Guide` is one sequence's matcher: it writes the mask of the tokens allowed after the ones it has consumed
(one bit an id, llguidance's int32 words), and consumes each token drawn. The decode batch (`DecodeBatch`) applies
the mask to a guided row's logits before its draw: the sampler then draws from the allowed tokens only, its top-k
and top-p among them (the spec's sampler over the logits with every other token's at -inf).

JSON comes in one line, items separated by ", " and keys by ": " (as Python's json.dumps writes it), no other
whitespace: a small model cannot then spend its tokens on blank lines (a schema's "x-guidance" options override).
llguidance is an optional dependency (the `grammar` extra, in `serve` too): a grammar without it is a
MissingExtraError naming the command that installs it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from llama_jax.errors import GrammarError, MissingExtraError
from llama_jax.text.tokenizer import Tokenizer

JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
KINDS = ("json_schema", "json_object", "gbnf", "lark", "regex")


def _llguidance():
    """The llguidance module, or MissingExtraError."""
    try:
        import llguidance
    except ImportError as e:
        raise MissingExtraError(
            f"constrained decoding needs llguidance ({e.name} is missing): pip install 'llama-jax[grammar]'"
        ) from e
    return llguidance


@dataclasses.dataclass(frozen=True)
class Grammar:
    """What a generated text must match: kind (one of KINDS) and llguidance's definition of it, checked when made
    (GrammarError naming the problem). Make one with its constructors: json_schema, json_object, gbnf, lark, regex,
    or response_format (OpenAI's request field)."""

    kind: str
    definition: str

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str | bool) -> Grammar:
        """A JSON value valid under the schema (a dict, or its JSON text), as OpenAI's strict json_schema."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from e
        if not isinstance(schema, Mapping | bool):
            raise GrammarError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
        ll = _llguidance()
        try:
            schema = json.dumps(schema) if isinstance(schema, bool) else dict(schema)
            definition = ll.LLMatcher.grammar_from_json_schema(schema, JSON_LAYOUT)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the JSON schema cannot be read: {e}") from e
        return cls._checked("json_schema", definition)

    @classmethod
    def json_object(cls) -> Grammar:
        """Any JSON object (OpenAI's response_format json_object)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def gbnf(cls, text: str) -> Grammar:
        """A grammar in llama.cpp's GBNF (its root rule `root`), as llama-server's `grammar` field takes it."""
        _check_text(text, "a GBNF grammar")
        ll = _llguidance()
        try:
            definition = ll.grammar_from("gbnf", text)
        except ValueError as e:
            raise GrammarError(f"the GBNF grammar cannot be read: {e}") from e
        return cls._checked("gbnf", definition)

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """A grammar in llguidance's Lark syntax (its root rule `start`)."""
        _check_text(text, "a Lark grammar")
        return cls._checked("lark", _llguidance().LLMatcher.grammar_from_lark(text))

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """A text the regular expression matches whole (Rust's regex syntax)."""
        _check_text(pattern, "a regular expression")
        return cls._checked("regex", _llguidance().LLMatcher.grammar_from_regex(pattern))

    @classmethod
    def response_format(cls, spec: Mapping[str, Any]) -> Grammar | None:
        """OpenAI's response_format: {"type": "text"} (None: no grammar), {"type": "json_object"} (with llama-server's
        optional "schema"), or {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
        (the schema enforced whatever strict says, as vLLM and llama-server do)."""
        if not isinstance(spec, Mapping) or spec.get("type") not in ("text", "json_object", "json_schema"):
            raise GrammarError('response_format must be {"type": "text" | "json_object" | "json_schema", ...}')
        kind = spec["type"]
        if kind == "text":
            _only(spec, {"type"}, "response_format")
            return None
        if kind == "json_object":
            _only(spec, {"type", "schema"}, "response_format")
            return cls.json_object() if spec.get("schema") is None else cls.json_schema(spec["schema"])
        _only(spec, {"type", "json_schema"}, "response_format")
        inner = spec.get("json_schema")
        if not isinstance(inner, Mapping):
            raise GrammarError('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
        _only(inner, {"name", "schema", "strict", "description"}, "response_format.json_schema")
        if "strict" in inner and not isinstance(inner["strict"], bool | None):
            raise GrammarError(f"response_format.json_schema.strict must be true or false, got {inner['strict']!r:.60}")
        return cls.json_schema(inner.get("schema", {}))

    @classmethod
    def _checked(cls, kind: str, definition: str) -> Grammar:
        error = _llguidance().LLMatcher.validate_grammar(definition)
        if error:
            raise GrammarError(f"the {kind.replace('_', ' ')} cannot be compiled: {error}")
        return cls(kind, definition)


def _check_text(text: Any, what: str) -> None:
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(f"{what} must be a non-empty string, got {text!r:.60}")


def _only(spec: Mapping[str, Any], keys: set[str], where: str) -> None:
    extra = sorted(set(spec) - keys)
    if extra:
        raise GrammarError(f"{where} takes {', '.join(sorted(keys))}; {extra[0]!r} is not one of them")


class Vocabulary:
    """llguidance's view of a model's vocabulary: each id's bytes (ids past the tokenizer's, a model's padding,
    stand for no text and are never allowed), its special tokens, and the ids that end a text (eos_ids: a guided
    text ends with one of them once its grammar is complete). Made once per model (a tenth of a second at a 49k
    vocabulary)."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: Sequence[int], vocab: int):
        if not eos_ids:
            raise GrammarError("constrained decoding needs an end-of-sequence token, and this model names none")
        ll = _llguidance()
        known = tokenizer.vocab_size
        added = tokenizer.backend.get_added_tokens_decoder()
        special = sorted(i for i, token in added.items() if token.special and i < vocab)
        wrapper = _TokenizerView(
            eos_token_id=int(eos_ids[0]),
            bos_token_id=tokenizer.special.bos,
            tokens=[tokenizer.token_bytes(i) if i < known else b"" for i in range(vocab)],
            special_token_ids=special,
            encode=lambda text: tokenizer.encode(text, add_special=False),
        )
        self.vocab = vocab
        self.words = -(-vocab // 32)  # int32 words of a mask
        eos = [int(i) for i in eos_ids]
        self.eos = frozenset(eos)
        self.tokenizer = ll.LLTokenizer(ll.TokenizerWrapper(wrapper), n_vocab=vocab, eos_token=eos)


@dataclasses.dataclass
class _TokenizerView:
    """What llguidance's TokenizerWrapper reads of a tokenizer; called with a text's UTF-8 bytes, it gives their ids
    (llguidance tokenizes forced text with it; bytes that are not UTF-8 are read with replacement characters)."""

    eos_token_id: int
    bos_token_id: int | None
    tokens: list[bytes]
    special_token_ids: list[int]
    encode: Callable[[str], list[int]]

    def __call__(self, text: bytes | str) -> list[int]:
        return self.encode(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


class Guide:
    """One sequence's matcher of a grammar: `fill` writes the mask of the tokens allowed next, `consume` takes the
    token drawn. Once its grammar is complete only the end-of-sequence ids are allowed; after one is consumed the
    guide is `done` and allows every token (the row's text has ended: what it draws is discarded). A failure
    inside llguidance (a token it did not allow, a grammar past its limits) leaves `error` set, its message, and
    allows every token too (the row's owner ends it with that error)."""

    def __init__(self, vocabulary: Vocabulary, grammar: Grammar, matcher: Any = None):
        self.vocabulary, self.grammar = vocabulary, grammar
        if matcher is None:
            matcher = _llguidance().LLMatcher(vocabulary.tokenizer, grammar.definition, log_level=0)
        self.matcher = matcher
        self.done = False  # an end-of-sequence id consumed
        if self.matcher.is_error():
            raise GrammarError(f"the {grammar.kind.replace('_', ' ')} cannot be compiled: {self.matcher.get_error()}")

    def fork(self) -> Guide:
        """A guide in this one's state, advanced apart from it (each choice of a request its own)."""
        fork = Guide(self.vocabulary, self.grammar, self.matcher.deep_copy())
        fork.done = self.done
        return fork

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def fill(self, mask: np.ndarray) -> None:
        """Writes the allowed tokens' bits into mask [words] (int32, C-contiguous): bit i % 32 of word i // 32 is
        token i's; all bits set when the guide is done or failed (the row's draws no longer count)."""
        if mask.dtype != np.int32 or mask.shape != (self.vocabulary.words,) or not mask.flags.c_contiguous:
            words = self.vocabulary.words
            raise GrammarError(f"a mask is {words} contiguous int32 words, got {mask.shape} {mask.dtype}")
        if self.done or self.matcher.is_error():
            mask[:] = -1
            return
        self.matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if self.matcher.is_error():
            mask[:] = -1

    def consume(self, token: int) -> None:
        """Advances past a token drawn from the mask (nothing once done or failed)."""
        if self.done or self.matcher.is_error():
            return
        self.matcher.consume_token(int(token))
        self.done = int(token) in self.vocabulary.eos


def allowed_ids(mask: np.ndarray, vocab: int) -> np.ndarray:
    """The ids a mask [words] allows, ascending."""
    bits = (mask[:, None] >> np.arange(32, dtype=np.int32)[None, :]) & 1  # [words, 32]
    return np.flatnonzero(bits.reshape(-1)[:vocab])
