"""RoPE's scalings against transformers: the frequencies (and YaRN's attention factor) of every kind equal those of
transformers' own `LlamaRotaryEmbedding` (which calls `ROPE_INIT_FUNCTIONS`), cos and sin at every position of
the context equal its forward's, whole random models of the llama3, linear, dynamic and YaRN kinds give its
logits; a GGUF carries llama3's scaling as llama.cpp's converter writes it (the `rope_freqs` divisors) and
linear and YaRN as `rope.scaling` keys, and computes what the config.json model computes."""

from __future__ import annotations

import math

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

import llama_jax
from llama_jax import LlamaConfig
from llama_jax.core.rope_scaling import RopeScaling
from llama_jax.errors import ConfigError
from llama_jax.nn.rope import inv_freq, rope_tables
from llama_jax.testing import greedy
from tests.gguf_builder import llama3_rope_freqs, write_gguf
from tests.helpers import hf_from_config, hf_from_json, hf_greedy, hf_logits, save_hf_checkpoint

torch = pytest.importorskip("torch")

LLAMA3 = RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)  # Llama 3.1/3.2's own
SCALINGS = {
    "default": RopeScaling(),
    "linear": RopeScaling("linear", 4.0),
    "dynamic": RopeScaling("dynamic", 2.0),
    "llama3-3.2": LLAMA3,
    "llama3-3.0": RopeScaling("llama3", 32.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0),  # Llama 3.2 1B/3B
    "yarn": RopeScaling("yarn", 4.0, 32768, attention_factor=0.1 * math.log(4.0) + 1.0),
    "yarn-untruncated": RopeScaling("yarn", 2.5, 4096, beta_fast=16.0, beta_slow=2.0, truncate=False,
                                    attention_factor=1.0),
}  # fmt: skip


def real_config(scaling: RopeScaling, half: int = 32, theta: float = 500000.0, context: int = 131072) -> LlamaConfig:
    """Llama-3.2-1B's attention sizes (head 64, theta 500000, 131072 positions) with the given scaling."""
    return LlamaConfig(kv=8, g=4, half=half, ffn=64, layers=1, vocab=300, theta=theta, context=context, rope=scaling)


def hf_rotary(config: LlamaConfig):
    from transformers import LlamaConfig as HFConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(HFConfig(**config.to_hf()))


@pytest.mark.parametrize("name", SCALINGS)
@pytest.mark.parametrize("half", [32, 64])
def test_frequencies_equal_transformers(name, half):
    """inv_freq bit for bit, and the attention factor, for heads of 64 and 128 at Llama 3's theta and context."""
    config = real_config(SCALINGS[name], half=half)
    rotary = hf_rotary(config)
    np.testing.assert_array_equal(inv_freq(config), rotary.inv_freq.numpy())
    assert np.float32(rotary.attention_scaling) == np.float32(config.rope.attention_factor)


@pytest.mark.parametrize("name", SCALINGS)
def test_cos_and_sin_equal_transformers_across_the_context(name):
    """cos and sin of transformers' forward at positions spread over the whole context (the last included): the
    same frequencies times the same positions, f32 cos and sin, YaRN's factor on both."""
    config = real_config(SCALINGS[name])
    positions = np.unique(np.r_[np.arange(64), np.geomspace(64, config.context - 1, 200).astype(np.int64)])
    cos, sin = hf_rotary(config)(torch.zeros(1, dtype=torch.float32), torch.tensor(positions[None]))
    mine = rope_tables(jnp.asarray(positions[None], jnp.int32), config)
    np.testing.assert_allclose(np.asarray(mine[0]), cos[..., : config.half].numpy(), rtol=0, atol=2e-6)
    np.testing.assert_allclose(np.asarray(mine[1]), sin[..., : config.half].numpy(), rtol=0, atol=2e-6)


# small models whose frequencies fall in every band of each kind: half 8 at theta 10000 turns once in 6.3, 20,
# 63, 199, ... positions, against original contexts of 32-64
SMALL = {
    "llama3": RopeScaling("llama3", 4.0, 64, low_freq_factor=1.0, high_freq_factor=4.0),
    "linear": RopeScaling("linear", 4.0),
    "dynamic": RopeScaling("dynamic", 3.0),
    "yarn": RopeScaling("yarn", 4.0, 32, attention_factor=0.1 * math.log(4.0) + 1.0),
}
IDS = np.random.default_rng(0).integers(0, 300, 200).tolist()


def small_config(scaling: RopeScaling) -> LlamaConfig:
    return LlamaConfig(kv=2, g=2, half=8, ffn=48, layers=2, vocab=300, theta=10000.0, context=256, rope=scaling)


@pytest.mark.slow
@pytest.mark.parametrize("name", SMALL)
def test_whole_model_equals_transformers(tmp_path, name):
    """A random model of each kind, saved by transformers and loaded from its config.json: logits at 200
    positions (past the original context) within 1e-4, and greedy decoding from the cache (positions 150-169)
    equal to transformers' generate."""
    config = small_config(SMALL[name])
    hf = hf_from_config(config, seed=5)
    model = llama_jax.load(save_hf_checkpoint(tmp_path / "ckpt", hf))
    assert model.config == config
    np.testing.assert_allclose(model.logits(IDS), hf_logits(hf, IDS), rtol=1e-4, atol=1e-4)
    assert greedy(model.weights, model.config, IDS[:150], 20, eos_ids=()) == hf_greedy(hf, IDS[:150], 20)


def gguf_of(tmp_path, config: LlamaConfig, hf, **meta) -> llama_jax.Model:
    """The random model as an F32 GGUF written as llama.cpp writes it, with these metadata keys (or rope_freqs)."""
    tensors = {n: p.detach().numpy() for n, p in hf.state_dict().items()}
    tensors.pop("lm_head.weight", None)
    return llama_jax.load(write_gguf(tmp_path / "model.gguf", config, tensors, gguf.GGMLQuantizationType.F32, **meta))


@pytest.mark.slow
def test_llama3_gguf_with_rope_freqs_equals_the_config_json_model(tmp_path):
    """Llama 3.x as llama.cpp converts it: no scaling key, the frequencies divided by `rope_freqs.weight`. Its
    logits equal transformers' on the safetensors it came from (which transformers' GGUF loader cannot give: it
    ignores rope_freqs), and the divisors are in the config, named by `llama-jax info`."""
    config = small_config(SMALL["llama3"])
    hf = hf_from_config(config, seed=6)
    divisors = llama3_rope_freqs(config)
    assert set(np.round(divisors, 3)) > {1.0, 4.0}  # kept, scaled and smoothed frequencies
    model = gguf_of(tmp_path, config, hf, rope_freqs=divisors)
    assert model.config.rope == RopeScaling(divisors=tuple(divisors.tolist()))
    np.testing.assert_allclose(inv_freq(model.config), inv_freq(config), rtol=2e-7)
    np.testing.assert_allclose(model.logits(IDS), hf_logits(hf, IDS), rtol=1e-4, atol=1e-4)
    assert "rope_freqs divisors 1..4" in model.config.rope.describe()
    with pytest.raises(ConfigError, match=r"rope_freqs tensor, which has no config\.json form; load the file itself"):
        llama_jax.convert_gguf(tmp_path / "model.gguf", tmp_path / "converted")
    assert not (tmp_path / "converted").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["linear", "yarn"])
def test_scaled_gguf_equals_the_config_json_model(tmp_path, name):
    """linear and YaRN as llama.cpp's converter writes them (`llama.rope.scaling.type`, `.factor`,
    `.original_context_length`): the same config as the config.json, and its logits."""
    config = small_config(SMALL[name])
    hf = hf_from_config(config, seed=7)
    meta = {"llama__rope__scaling__type": name, "llama__rope__scaling__factor": config.rope.factor}
    if name == "yarn":
        meta["llama__rope__scaling__original_context_length"] = config.rope.original_context
    model = gguf_of(tmp_path, config, hf, **meta)
    assert model.config == config
    np.testing.assert_allclose(model.logits(IDS), hf_logits(hf, IDS), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", [n for n in SCALINGS if n != "default"])
def test_config_json_round_trip(name):
    """to_hf then from_hf gives the same config, for every kind."""
    config = real_config(SCALINGS[name])
    assert LlamaConfig.from_hf(config.to_hf()) == config


def test_the_published_llama_3_2_rope_scaling_is_read():
    """Llama-3.2-1B's config.json fields (rope_scaling with rope_type llama3) and the older {"type": "linear"}."""
    hf = real_config(RopeScaling()).to_hf() | {"rope_theta": 500000.0}
    hf["rope_scaling"] = {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 8192, "rope_type": "llama3"}  # fmt: skip
    assert LlamaConfig.from_hf(hf).rope == RopeScaling("llama3", 32.0, 8192, 1.0, 4.0)
    hf["rope_scaling"] = {"type": "linear", "factor": 4.0}  # deepseek-coder's
    assert LlamaConfig.from_hf(hf).rope == RopeScaling("linear", 4.0)


def test_fields_transformers_ignores_in_rope_scaling_are_ignored():
    """transformers warns about a rope_scaling field its rope_type does not read and computes without it:
    NousResearch's Yarn-Llama-2 fine-tunes' `finetuned`, and any other name no kind of scaling computes with."""
    hf = real_config(RopeScaling()).to_hf()
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096}
    plain = LlamaConfig.from_hf(hf | {"rope_scaling": yarn}).rope
    assert LlamaConfig.from_hf(hf | {"rope_scaling": yarn | {"finetuned": True}}).rope == plain
    linear = {"rope_type": "linear", "factor": 2.0}
    assert LlamaConfig.from_hf(hf | {"rope_scaling": linear | {"smoothing": 1.0}}).rope == RopeScaling("linear", 2.0)


@pytest.mark.parametrize(
    ("rope", "match"),
    [
        ({"rope_type": "longrope", "short_factor": [1.0] * 32, "original_max_position_embeddings": 4096},
         "'longrope' needs the field 'long_factor'"),
        ({"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 31,
          "original_max_position_embeddings": 4096}, "short_factor and long_factor, one number a frequency each"),
        ({"rope_type": "linear"}, "'linear' needs the field 'factor'"),
        ({"rope_type": "linear", "factor": -2.0}, "needs a positive factor"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0},
         "low_freq_factor < high_freq_factor"),
        ({"rope_type": "linear", "factor": 2.0, "beta_fast": 16.0}, "field 'beta_fast', with which another kind"),
        ({"rope_type": "yarn", "factor": 4.0, "low_freq_factor": 1.0}, "field 'low_freq_factor', with which another"),
        ({"rope_type": "yarn", "factor": 2.0, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
    ],
)  # fmt: skip
def test_unsupported_or_malformed_scalings_are_refused_by_name(rope, match):
    hf = real_config(RopeScaling()).to_hf() | {"rope_scaling": rope}
    with pytest.raises(ConfigError, match=match):
        LlamaConfig.from_hf(hf, source="test/config.json")


@pytest.mark.parametrize(
    ("meta", "match"),
    [
        ({"llama__rope__scaling__type": "longrope"}, "'longrope' .* is not supported"),
        ({"llama__rope__scaling__type": "linear"}, "'linear' needs the field 'factor'"),
        ({"llama__rope__scaling__type": "yarn", "llama__rope__scaling__factor": 4.0,
          "llama__rope__scaling__attn_factor": 0.5}, "attn_factor is 0.5"),
        ({"rope_freqs": np.ones(3, np.float32)}, "divisors .* are 3, not one per frequency"),
        ({"rope_freqs": np.zeros(8, np.float32)}, "must be positive finite"),
    ],
)  # fmt: skip
def test_unsupported_or_malformed_gguf_scalings_are_refused_by_name(tmp_path, meta, match):
    config = small_config(RopeScaling())
    tensors = {n: p.detach().numpy() for n, p in hf_from_config(config).state_dict().items()}
    tensors.pop("lm_head.weight", None)
    path = write_gguf(tmp_path / "model.gguf", config, tensors, **meta)
    with pytest.raises(ConfigError, match=match):
        llama_jax.load(path)


def _phi3_longrope(original: int = 16, context: int = 64, seed: int = 1) -> LlamaConfig:
    """A small Phi-3 of longrope factors (random, one per frequency), trained at `original` positions."""
    rng = np.random.default_rng(seed)
    half = 8
    factor = context / original
    short, long = tuple(1 + rng.uniform(0, 1, half)), tuple(1 + rng.uniform(0, 30, half))
    attention = math.sqrt(1 + math.log(factor) / math.log(original))
    rope = RopeScaling("longrope", factor, original, attention_factor=attention, short_factor=short, long_factor=long)
    return LlamaConfig(kv=2, g=2, half=half, ffn=96, layers=2, vocab=512, context=context, rope=rope, family="phi3")


def test_longrope_frequencies_are_transformers_short_and_long_ones():
    """Phi-3's LongRoPE: the short factors' frequencies (a sequence of at most the original context) and the long
    ones' (past it) bit for bit as transformers' `_compute_longrope_parameters`, its attention factor too."""
    from transformers import Phi3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _phi3_longrope(original=4096, context=131072)
    hf = Phi3Config(**config.to_hf() | {"original_max_position_embeddings": 4096})
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, "cpu", seq_len=4097)
    np.testing.assert_array_equal(inv_freq(config), short.numpy())
    np.testing.assert_array_equal(inv_freq(config, long=True), long.numpy())
    assert np.float32(factor) == np.float32(config.rope.attention_factor)


@pytest.mark.parametrize("native", ["off", "auto"])
def test_longrope_takes_each_sequence_s_factors_by_its_own_length(tmp_path, native):
    """A sequence of at most the original context (16 here) computes with the short factors, a longer one with the
    long ones: each as transformers' forward of it alone (within 2x its float32's distance from float64), the same
    bits alone and in one batch (scored together); and from a GGUF written as llama.cpp's converter writes Phi-3's
    longrope (its rope_factors tensors) the same bits as from the directory."""
    config = _phi3_longrope()
    hf = hf_from_json(config.to_hf() | {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}, seed=4)
    directory = save_hf_checkpoint(tmp_path / "hf", hf)
    model = llama_jax.load(directory, native=native)
    assert model.config.rope == config.rope
    rng = np.random.default_rng(5)
    short, long = [int(i) for i in rng.integers(0, 512, 12)], [int(i) for i in rng.integers(0, 512, 40)]
    for ids in (short, long):
        f64, f32 = hf_logits(hf.double(), ids), hf_logits(hf.float(), ids)
        hf.float()
        assert np.abs(model.logits(ids) - f64).max() <= 2 * np.abs(f32 - f64).max()
    together = model.score([short, long], batch_size=2)
    for i, ids in enumerate((short, long)):
        np.testing.assert_array_equal(together[i].logprobs, model.score([ids], batch_size=1)[0].logprobs)
    tensors = {n: p.detach().numpy() for n, p in hf.state_dict().items()}
    path = write_gguf(tmp_path / "model.gguf", config, tensors)
    from_gguf = llama_jax.load(path, native=native)
    for past in (False, True):  # the GGUF holds the factors and the attention factor in f32: the same f32 values
        np.testing.assert_array_equal(inv_freq(from_gguf.config, past), inv_freq(config, past))
    assert np.float32(from_gguf.config.rope.attention_factor) == np.float32(config.rope.attention_factor)
    np.testing.assert_array_equal(from_gguf.logits(long), model.logits(long))


def _generation_logprobs(model, prompts: list[list[int]], new: int, joined: bool = False) -> tuple[np.ndarray, ...]:
    """Greedy generation of `new` tokens after each prompt, in one decode batch (prefilled together, or joined:
    each prompt prefilled alone and joined to free rows, as the server's engine runs them): the tokens [B, new] and
    the log-probability each was drawn with [B, new]."""
    from llama_jax.passes.decode_batch import DecodeBatch, RowSettings, prefill_row
    from llama_jax.passes.generate import plan_capacity
    from llama_jax.passes.sampling import Sampling

    m, native = model, model.native.active
    capacity = plan_capacity(max(map(len, prompts)), new, m.config)
    settings = RowSettings.of(Sampling(), np.zeros(len(prompts), np.uint32), m.config.vocab)
    if joined:
        batch = DecodeBatch.empty(m.config, len(prompts), capacity)
        for row, ids in enumerate(prompts):
            one = RowSettings.of(Sampling(), np.zeros(1, np.uint32), m.config.vocab)
            batch = batch.join(row, prefill_row(m.weights, m.config, ids, capacity, native), one)
    else:
        batch = DecodeBatch.prefill(m.weights, m.config, [np.asarray(p) for p in prompts], capacity, settings, native)
    tokens, chosen = [], []
    while sum(t.shape[1] for t in tokens) < new:
        batch, out, lp = batch.advance(m.weights, m.config, native, logprobs=1)
        tokens.append(out)
        chosen.append(lp.chosen)
    return np.concatenate(tokens, 1)[:, :new], np.concatenate(chosen, 1)[:, :new]


def _hf_generation_logprobs(hf, ids: list[int], new: int) -> tuple[np.ndarray, np.ndarray]:
    """transformers' greedy `generate` after ids (Phi-3's: its cache dropped where longrope switches to the long
    factors): the tokens [new] and each one's log-probability under the logits it was drawn from [new]."""
    with torch.no_grad():
        x = torch.tensor([ids])
        out = hf.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False, eos_token_id=None,
            pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens = out.sequences[0, len(ids) :].numpy()
    logits = torch.stack(out.logits)[:, 0].double()  # [new, V]
    lp = torch.log_softmax(logits, -1)[torch.arange(new), out.sequences[0, len(ids) :]]
    return tokens, lp.numpy()


@pytest.mark.parametrize("native", ["off", "auto"])
def test_generation_crossing_the_original_context_draws_from_the_whole_sequence_computed_again(tmp_path, native):
    """longrope changes every position's frequencies when a sequence grows past the original context (16 here):
    a generation that crosses it computes the sequence again with the long factors, as transformers' Phi-3 drops its
    cache there. Each token is drawn from the logits of its whole sequence so far: the same tokens as transformers'
    generate, each one's log-probability within 2x transformers float32's distance from float64's; the row gets
    the same bits in a batch beside a row that crosses at another step, prefilled together or joined as the
    server's rows are."""
    config = _phi3_longrope()
    hf = hf_from_json(config.to_hf() | {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}, seed=4)
    model = llama_jax.load(save_hf_checkpoint(tmp_path / "hf", hf), native=native)
    ids = [int(i) for i in np.random.default_rng(6).integers(3, 512, 11)]
    tokens, lp = _generation_logprobs(model, [ids], 14)  # positions 11..24: the 6th new token crosses
    f32_tokens, f32 = _hf_generation_logprobs(hf.float(), ids, 14)
    f64_tokens, f64 = _hf_generation_logprobs(hf.double(), ids, 14)
    hf.float()
    np.testing.assert_array_equal(tokens[0], f32_tokens)
    np.testing.assert_array_equal(tokens[0], f64_tokens)
    assert np.abs(lp[0] - f64).max() <= 2 * np.abs(f32 - f64).max()
    beside = [int(i) for i in np.random.default_rng(7).integers(3, 512, 4)]
    for joined in (False, True):
        together_tokens, together = _generation_logprobs(model, [beside, ids], 14, joined)
        np.testing.assert_array_equal(together_tokens[1], tokens[0])
        np.testing.assert_array_equal(together[1], lp[0])
