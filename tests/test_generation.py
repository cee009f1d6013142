"""Generation on the default model: seeded draws reproducible (across runs, in a fresh process, alone or inside a
batch, eager or jitted), batches equal to their sequences run alone, streaming equal to generate on multi-byte
text, stop strings, and chat with the checkpoint's template."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from llama_jax import CapacityError, SamplingError
from llama_jax import sampling as S

pytestmark = pytest.mark.slow

SAMPLED = {"temperature": 0.9, "top_k": 50, "top_p": 0.95}
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "My favourite emoji is"]


def test_the_same_seed_gives_the_same_text_and_another_seed_another(model):
    a = model.generate(PROMPTS[1], max_new_tokens=24, seed=11, **SAMPLED)
    assert model.generate(PROMPTS[1], max_new_tokens=24, seed=11, **SAMPLED) == a
    assert model.generate(PROMPTS[1], max_new_tokens=24, seed=12, **SAMPLED) != a


def test_a_fresh_process_draws_the_same_tokens(model):
    code = (
        "import json, llama_jax; m = llama_jax.load();"
        f"print(json.dumps(m.generate_ids(m.tokenizer.encode({PROMPTS[1]!r}), max_new_tokens=16, seed=5,"
        " temperature=0.9, top_k=50, top_p=0.95)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    ids = model.generate_ids(model.tokenizer.encode(PROMPTS[1]), max_new_tokens=16, seed=5, **SAMPLED)
    assert json.loads(out.stdout) == ids


@pytest.mark.parametrize("settings", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_each_sequence_of_a_batch_gets_the_tokens_it_gets_alone(model, settings):
    """Prompts of different lengths padded into one batch: sequence b (seed 20 + b) equals its own run."""
    together = model.generate(PROMPTS, max_new_tokens=20, seed=20, **settings)
    alone = [model.generate(p, max_new_tokens=20, seed=20 + b, **settings) for b, p in enumerate(PROMPTS)]
    assert together == alone
    if settings:  # a list of seeds: sequence b draws with seeds[b]
        listed = model.generate(PROMPTS[:2], max_new_tokens=20, seed=[22, 21], **settings)
        assert listed == [model.generate(PROMPTS[0], max_new_tokens=20, seed=22, **settings), alone[1]]


def test_jitted_draws_equal_eager_draws_on_the_full_forward_logits(model):
    """Each token the jitted, batched generation loop drew is what the eager sampler draws from the uncached
    forward's logits at that step with uniform(seed, i)."""
    prompt = model.tokenizer.encode(PROMPTS[0])
    ids = model.generate_ids(prompt, max_new_tokens=12, seed=3, **SAMPLED)
    for i, token in enumerate(ids):
        logits = model.logits(prompt + ids[:i])[-1]
        u = float(S.uniform(3, i))
        assert S.sample(logits, SAMPLED["temperature"], SAMPLED["top_k"], SAMPLED["top_p"], u) == token


def test_streaming_yields_exactly_the_generated_text_on_multibyte_output(model):
    """Emoji and accented text: some tokens end inside a character, and the stream still joins to generate's
    text, each piece whole characters (but the last, when the token limit cuts a character: its text is the
    decoder's U+FFFD, as in generate's)."""
    cases = [
        ("My favourite emoji is", {"seed": 4, "temperature": 0.8, "top_k": 50}),
        ("Traduis en français : « Le café est très chaud »", {}),
        ("Emoji list: 🙂 🚀 🎉", {"seed": 1, "temperature": 1.0}),
    ]
    split_seen = False
    for prompt, settings in cases:
        pieces = list(model.stream(prompt, max_new_tokens=30, **settings))
        assert "".join(pieces) == model.generate(prompt, max_new_tokens=30, **settings)
        assert all("\ufffd" not in p for p in pieces[:-1])
        ids = model.generate_ids(model.tokenizer.encode(prompt), max_new_tokens=30, **settings)
        split_seen |= any("\ufffd" in model.tokenizer.decode([i]) for i in ids)
    assert split_seen, "no generated token ended inside a character: the test lost its point"


def test_stop_strings_end_the_text_before_them(model):
    full = model.generate(PROMPTS[1], max_new_tokens=40)
    stop = full[10:14]
    cut = model.generate(PROMPTS[1], max_new_tokens=40, stop=[stop, "never appears"])
    assert cut == full[: full.index(stop)]
    assert "".join(model.stream(PROMPTS[1], max_new_tokens=40, stop=stop)) == cut


def test_chat_prompt_equals_transformers_chat_template(model, default_path):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(default_path.parent), gguf_file=default_path.name)
    conversations = [
        [{"role": "user", "content": "Hi!"}],
        [
            {"role": "system", "content": "You answer in French."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "Quatre."},
            {"role": "user", "content": "Et 3×3 ?"},
        ],
    ]
    for messages in conversations:
        assert model.chat_prompt(messages) == hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )


def test_the_instruct_model_answers_a_question(model):
    answer = model.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=48)
    assert "Paris" in answer


def test_capacity_and_settings_are_checked_up_front(model):
    long_prompt = [1] * 8000
    with pytest.raises(CapacityError, match="8000 tokens plus 500 new tokens needs 8500 positions"):
        model.generate_ids(long_prompt, max_new_tokens=500)
    with pytest.raises(SamplingError, match="top_p"):
        model.generate(PROMPTS[0], top_p=0.0)
    with pytest.raises(SamplingError, match="seed"):
        model.generate(PROMPTS[0], seed=2**32)
    with pytest.raises(SamplingError, match="2 seeds for 3 sequences"):
        model.generate(PROMPTS, seed=[1, 2])
    assert np.isfinite(model.logits([1, 2, 3])).all()
