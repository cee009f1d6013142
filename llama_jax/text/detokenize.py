"""Text from a growing list of token ids, piece by piece, such that the pieces join to exactly the final text.

Two things make a naive "decode the new token" wrong: a byte-level BPE token may end in the middle of a UTF-8
character (decoding it alone gives U+FFFD), and a stop string may span several tokens (text that could be the
start of one must not be shown until it is known not to be). So each step decodes all ids so far and releases
only the text that no later token can change: before a trailing incomplete character, and before any suffix
that is a prefix of a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

from llama_jax.text.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class TextStream:
    """One sequence's new ids and text. `add(id)` returns the text it releases; `done` once it reached an
    end-of-sequence id or a stop string; `finish()` the rest. The released pieces join to `text`."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: Sequence[int], stop: Sequence[str] = ()):
        self.tokenizer, self.eos_ids, self.stop = tokenizer, frozenset(eos_ids), tuple(s for s in stop if s)
        self.ids: list[int] = []  # the new ids, an end-of-sequence id included
        self.text_ids: list[int] = []  # the ids whose text counts
        self.text = ""  # released so far
        self.done = False

    def add(self, token: int) -> str:
        if self.done:
            return ""
        self.ids.append(token)
        if token in self.eos_ids:
            return self.finish()
        self.text_ids.append(token)
        text = self.tokenizer.decode(self.text_ids)
        cut = self._first_stop(text)
        if cut is not None:
            self.done = True
            return self._release(text[:cut])
        safe = len(text.rstrip(_REPLACEMENT))  # a trailing U+FFFD may be half a character
        safe -= self._held_for_stop(text[:safe])
        return self._release(text[:safe])

    def finish(self) -> str:
        """The sequence ended (an end-of-sequence id, or the token limit): the text not yet released."""
        if self.done:
            return ""
        self.done = True
        return self._release(self.tokenizer.decode(self.text_ids))

    def _release(self, text: str) -> str:
        """text is final up to its end and extends what was released before."""
        piece = text[len(self.text) :]
        if piece:
            self.text = text
        return piece

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _held_for_stop(self, text: str) -> int:
        """The length of the longest suffix of text that begins some stop string (and so may become one)."""
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held
