"""Generation: the decode step traced once per generation and prefill once per length bucket, padding that changes no
logit, up-front capacity and id errors; and on the default model: greedy text and the end-of-sequence stop, seeded
draws reproducible (across runs, in a fresh process, alone or inside a batch, eager or jitted), batches equal to
their sequences run alone, streaming equal to generate on multi-byte text, stop strings, and chat with the
checkpoint's template."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import llama_jax
from llama_jax import CapacityError, InvalidArgumentError, SamplingError, TokenIdError
from llama_jax import sampling as S
from llama_jax.loaders.checkpoint import Checkpoint
from llama_jax.passes import cached, decode_batch
from llama_jax.testing import byte_tokenizer, greedy, random_weights, tiny_config
from tests.helpers import count_traces

SAMPLED = {"temperature": 0.9, "top_k": 50, "top_p": 0.95}
PROMPTS = ["The capital of France is", "Once upon a time, in a small village,", "My favourite emoji is"]


def tiny_model(**config) -> llama_jax.Model:
    c = tiny_config(**config)
    return llama_jax.Model(Checkpoint(c, random_weights(c), byte_tokenizer(), None, (256,), "tiny"))


def test_a_100_token_generation_traces_the_decode_step_once(monkeypatch):
    """No recompilation per token: 100 new tokens in device loops of CHUNK, one traced decode loop, one prefill."""
    model = tiny_model(layers=1, ffn=20)
    count_traces(monkeypatch, decode_batch, "decode_chunk", decode_batch.DECODE_JIT, n=1)
    count_traces(monkeypatch, cached, "_extend_jit", cached.EXTEND_JIT, n=1)
    new = greedy(model.weights, model.config, [1, 2, 3], 100, eos_ids=())
    assert len(new) == 100


def test_prefill_compiles_once_per_length_bucket(monkeypatch):
    """Prompts of 3, 9 and 16 tokens share the 16-token bucket; 17 tokens take the next one (32): a second trace."""
    model = tiny_model(layers=1, ffn=28)
    count_traces(monkeypatch, cached, "_extend_jit", cached.EXTEND_JIT, n=1)
    for n in (3, 9, 16):
        greedy(model.weights, model.config, list(range(1, n + 1)), 2, eos_ids=())
    with pytest.raises(AssertionError, match="traced > 1 times"):
        greedy(model.weights, model.config, list(range(1, 18)), 2, eos_ids=())


def test_padding_to_a_bucket_changes_no_logit():
    """A prompt padded to its bucket gives the same next-token logits as the unpadded prompt prefilled alone."""
    model = tiny_model()
    ids = np.array([[5, 9, 250, 3, 3]], np.int32)
    padded = np.zeros((1, 16), np.int32)
    padded[0, :5] = ids
    a, _ = llama_jax.prefill(model.weights, llama_jax.KVCache.empty(model.config, 1, 16), ids, model.config)
    b, _ = llama_jax.prefill(model.weights, llama_jax.KVCache.empty(model.config, 1, 16), padded, model.config, n=5)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(a[0]), model.logits(ids[0])[-1], rtol=1e-5, atol=1e-5)


def test_capacity_errors_come_up_front_with_both_numbers():
    model = tiny_model()  # context 128
    with pytest.raises(CapacityError, match="100 tokens plus 29 new tokens needs 129 positions, past the model's"):
        model.generate_ids(list(range(100)), max_new_tokens=29)
    with pytest.raises(CapacityError, match="129 tokens exceed the model's context of 128"):
        model.logits([1] * 129)
    with pytest.raises(InvalidArgumentError, match="empty"):
        model.generate_ids([], max_new_tokens=3)
    with pytest.raises(InvalidArgumentError, match="non-empty 1-D sequence"):
        model.logits([])


def test_bad_ids_are_refused_by_the_api():
    model = tiny_model()
    with pytest.raises(TokenIdError, match=r"token id 260 is outside the vocabulary \[0, 260\)"):
        model.logits([1, 260])
    with pytest.raises(TokenIdError, match="token id -3"):
        model.generate_ids([-3], max_new_tokens=2)
    with pytest.raises(InvalidArgumentError, match="integers"):
        model.logits(np.array([1.5, 2.0]))


@pytest.mark.slow
def test_the_instruct_model_answers_and_stops_at_end_of_sequence(model):
    """A chat prompt: the answer names Paris, and generation stops at <|im_end|> (id 2) before the limit."""
    prompt = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = model.generate_ids(model.tokenizer.encode(prompt), max_new_tokens=64)
    assert ids[-1] == 2 and len(ids) < 64
    text = model.generate(prompt, max_new_tokens=64)
    assert "Paris" in text and "<|im_end|>" not in text
    assert text == model.tokenizer.decode(ids[:-1])


@pytest.mark.slow
def test_the_same_seed_gives_the_same_text_and_another_seed_another(model):
    a = model.generate(PROMPTS[1], max_new_tokens=24, seed=11, **SAMPLED)
    assert model.generate(PROMPTS[1], max_new_tokens=24, seed=11, **SAMPLED) == a
    assert model.generate(PROMPTS[1], max_new_tokens=24, seed=12, **SAMPLED) != a


@pytest.mark.slow
def test_a_fresh_process_draws_the_same_tokens(model):
    code = (
        "import json, llama_jax; m = llama_jax.load();"
        f"print(json.dumps(m.generate_ids(m.tokenizer.encode({PROMPTS[1]!r}), max_new_tokens=16, seed=5,"
        " temperature=0.9, top_k=50, top_p=0.95)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    ids = model.generate_ids(model.tokenizer.encode(PROMPTS[1]), max_new_tokens=16, seed=5, **SAMPLED)
    assert json.loads(out.stdout) == ids


@pytest.mark.slow
@pytest.mark.parametrize("settings", [{}, SAMPLED], ids=["greedy", "sampled"])
def test_each_sequence_of_a_batch_gets_the_tokens_it_gets_alone(model, settings):
    """Prompts of different lengths padded into one batch: sequence b (seed 20 + b) equals its own run."""
    together = model.generate(PROMPTS, max_new_tokens=20, seed=20, **settings)
    alone = [model.generate(p, max_new_tokens=20, seed=20 + b, **settings) for b, p in enumerate(PROMPTS)]
    assert together == alone
    if settings:  # a list of seeds: sequence b draws with seeds[b]
        listed = model.generate(PROMPTS[:2], max_new_tokens=20, seed=[22, 21], **settings)
        assert listed == [model.generate(PROMPTS[0], max_new_tokens=20, seed=22, **settings), alone[1]]


@pytest.mark.slow
def test_jitted_draws_equal_eager_draws_on_the_full_forward_logits(model):
    """Each token the jitted, batched generation loop drew is what the eager sampler draws from the uncached
    forward's logits at that step with uniform(seed, i)."""
    prompt = model.tokenizer.encode(PROMPTS[0])
    ids = model.generate_ids(prompt, max_new_tokens=12, seed=3, **SAMPLED)
    for i, token in enumerate(ids):
        logits = model.logits(prompt + ids[:i])[-1]
        u = float(S.uniform(3, i))
        assert S.sample(logits, SAMPLED["temperature"], SAMPLED["top_k"], SAMPLED["top_p"], u) == token


@pytest.mark.slow
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


@pytest.mark.slow
def test_stop_strings_end_the_text_before_them(model):
    full = model.generate(PROMPTS[1], max_new_tokens=40)
    stop = full[10:14]
    cut = model.generate(PROMPTS[1], max_new_tokens=40, stop=[stop, "never appears"])
    assert cut == full[: full.index(stop)]
    assert "".join(model.stream(PROMPTS[1], max_new_tokens=40, stop=stop)) == cut


@pytest.mark.slow
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


@pytest.mark.slow
def test_the_instruct_model_answers_a_question(model):
    answer = model.chat([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=48)
    assert "Paris" in answer


@pytest.mark.slow
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
