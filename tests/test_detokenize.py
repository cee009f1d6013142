"""Streaming text: the pieces a TextStream releases join to exactly the final text, whole characters only, and
never text that a stop string later cuts. A byte-level tokenizer with no merges splits every multi-byte
character across tokens, the hardest case."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from llama_jax.testing import byte_tokenizer
from llama_jax.text.detokenize import TextStream

TOK = byte_tokenizer()
EOS = 256


def run(text: str, stop=(), eos_after: bool = False) -> tuple[list[str], TextStream]:
    stream = TextStream(TOK, [EOS], stop)
    pieces = [stream.add(i) for i in TOK.encode(text) + ([EOS] if eos_after else [])]
    pieces.append(stream.finish())
    return [p for p in pieces if p], stream


def test_a_character_split_across_tokens_comes_whole():
    pieces, stream = run("héllo 🙂!")
    assert "".join(pieces) == stream.text == "héllo 🙂!"
    assert "🙂" in pieces or any("🙂" in p for p in pieces)
    assert all("\ufffd" not in p for p in pieces)


def test_end_of_sequence_ends_the_text_without_its_token():
    stream = TextStream(TOK, [EOS])
    for i in [*TOK.encode("ab"), EOS, *TOK.encode("cd")]:
        stream.add(i)
    assert stream.done and stream.text == "ab" and stream.ids[-1] == EOS and len(stream.ids) == 3


def test_stop_string_spanning_tokens_is_cut_and_never_shown():
    pieces, stream = run("one, two, three", stop=[", thr"])
    assert stream.text == "one, two" and "".join(pieces) == "one, two"
    assert stream.done and len(stream.ids) == len(TOK.encode("one, two, thr"))


def test_text_held_for_a_possible_stop_string_is_released_when_it_is_not_one():
    stream = TextStream(TOK, [EOS], ["ab!"])
    shown = "".join(stream.add(i) for i in TOK.encode("xab"))
    assert shown == "x"  # "ab" may begin "ab!"
    shown += "".join(stream.add(i) for i in TOK.encode("c"))
    assert shown == "xabc"


@settings(max_examples=200, deadline=None)
@example(text="a🙂a", stop=["🙂", "a🙂a"], eos=False)
@given(
    text=st.text(alphabet=st.sampled_from(list("ab ,é🙂\n")), max_size=30),
    stop=st.lists(st.text(alphabet=st.sampled_from(list("ab,é🙂")), min_size=1, max_size=3), max_size=2),
    eos=st.booleans(),
)
def test_pieces_always_join_to_the_final_text(text, stop, eos):
    """For any text and stop strings: the pieces join to the text cut where generation stops, which is as soon as
    some stop string is complete (as transformers' StopStringCriteria), before the earliest one then present. With
    overlapping stop strings this can differ from cutting the whole text at its first stop string: for "a🙂a" and
    stops ("🙂", "a🙂a") generation stops at "a🙂" and keeps "a"."""
    pieces, stream = run(text, stop, eos_after=eos)
    expected = text
    for end in range(1, len(text) + 1):
        cuts = [text[:end].find(s) for s in stop if s in text[:end]]
        if cuts:
            expected = text[: min(cuts)]
            break
    assert "".join(pieces) == stream.text == expected
