"""The compatibility table (docs/compatibility.md): one random-weight model per published config.json of the
family and its relatives (configs/family), scaled down to 2 layers, 2 key/value heads and a 512-token vocabulary,
everything that computes differently kept (head size, grouped-query ratio, hidden size beside heads·head size,
RoPE base and scaling, norm epsilon, tied head, sliding window, biases, per-head norms, layers without RoPE,
Granite's scalars). Loaded by llama-jax from a Hugging Face directory holding the published fields and from a GGUF
written as llama.cpp's converter writes it (its architecture's keys and tensors), compared with transformers: logits as
close to transformers' float64 as its float32 is (within 2x, the accuracy rule; the floor at least 1e-4, the
suite's logit bound, since one float32 run's error is one draw), and greedy tokens equal."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

import llama_jax
from llama_jax.testing import greedy
from tests.gguf_builder import llama3_rope_freqs, write_gguf
from tests.helpers import hf_from_json, hf_greedy, hf_logits, save_hf_checkpoint

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.slow

FAMILY = Path(__file__).resolve().parent.parent / "configs" / "family"
NAMES = sorted(p.stem for p in FAMILY.glob("*.json"))
SWITCHES = (
    "biases",
    "head_norms",
    "nope_layers",
    "embedding_multiplier",
    "residual_multiplier",
    "attention_scale",
    "logits_scaling",
)
IDS = [int(i) for i in np.random.default_rng(0).integers(0, 512, 96)]


def scaled_down(published: dict) -> dict:
    """The published fields with fewer layers, heads and tokens: the head size, the grouped-query ratio and the
    hidden size's ratio to heads·head size kept; ffn about as many times the hidden size; a context of 16384 at most
    (no position past it is run, and the scalings used here do not read it); SmolLM3's first 4 layers (the fourth
    without RoPE: llama.cpp's fixed step, which its GGUF then says too)."""
    c = dict(published)
    heads = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or heads
    head = c.get("head_dim") or c["hidden_size"] // heads
    new_kv = min(kv, 2)
    new_heads = new_kv * (heads // kv)
    hidden = c["hidden_size"] * new_heads // heads
    ffn = c["intermediate_size"] * hidden // c["hidden_size"]
    c.update(num_hidden_layers=2, num_attention_heads=new_heads, num_key_value_heads=new_kv, hidden_size=hidden)
    c.update(intermediate_size=ffn, vocab_size=512, bos_token_id=1, eos_token_id=2)
    c["max_position_embeddings"] = min(c["max_position_embeddings"], 16384)
    if c.get("no_rope_layers"):
        c["num_hidden_layers"] = 4
        c["no_rope_layers"], c["layer_types"] = c["no_rope_layers"][:4], c["layer_types"][:4]
    if c.get("pad_token_id") is not None:
        c["pad_token_id"] = 0
    if "head_dim" in c:
        c["head_dim"] = head
    return c


def _gguf(tmp_path: Path, model: llama_jax.Model, hf) -> Path:
    """The model as llama.cpp's converter writes it: its RoPE scaling as the llama.rope.scaling keys, llama3's as
    rope_freqs divisors."""
    config, meta, rope_freqs = model.config, {}, None
    if config.rope.kind == "llama3":
        rope_freqs = llama3_rope_freqs(config)
    elif config.rope.kind == "linear":
        meta = {"llama__rope__scaling__type": "linear", "llama__rope__scaling__factor": config.rope.factor}
    tensors = {n: p.detach().numpy() for n, p in hf.state_dict().items()}
    if config.tied:
        tensors.pop("lm_head.weight", None)
    f32 = gguf.GGMLQuantizationType.F32
    return write_gguf(tmp_path / "model.gguf", config, tensors, f32, rope_freqs=rope_freqs, **meta)


def row(name: str, tmp_path: Path):
    """A row's random model: transformers' (float32), its HF directory and GGUF file, and transformers' float64
    logits of IDS."""
    published = json.loads((FAMILY / f"{name}.json").read_text())
    small = scaled_down(published)
    hf = hf_from_json(small, seed=len(name))
    directory = save_hf_checkpoint(tmp_path / "hf", hf)
    (directory / "config.json").write_text(json.dumps(small))  # the published fields, not transformers' rewrite
    path = _gguf(tmp_path, llama_jax.load(directory), hf)
    f64 = hf_logits(hf.double(), IDS).astype(np.float64)
    return hf.float(), directory, path, f64


def distances(name: str, tmp_path: Path) -> dict[str, float]:
    """max |Δlogit| of llama-jax (HF directory; GGUF) and of transformers float32 from transformers float64."""
    hf, directory, path, f64 = row(name, tmp_path)
    from_dir, from_gguf = llama_jax.load(directory), llama_jax.load(path)
    f32 = hf_logits(hf, IDS)
    out = {
        "transformers f32": float(np.abs(f32 - f64).max()),
        "llama-jax dir": float(np.abs(from_dir.logits(IDS) - f64).max()),
        "llama-jax gguf": float(np.abs(from_gguf.logits(IDS) - f64).max()),
        "dir vs transformers f32": float(np.abs(from_dir.logits(IDS) - f32).max()),
    }
    expected = hf_greedy(hf, IDS[:8], 12)
    for model in (from_dir, from_gguf):
        assert greedy(model.weights, model.config, IDS[:8], 12, eos_ids=()) == expected
    window = from_dir.config.sliding_window if from_dir.config.family == "phi3" else None
    assert from_gguf.config.sliding_window == window  # llama.cpp's llama architecture has no window key, phi3's has
    for switch in SWITCHES:  # the same switches, read from the GGUF's keys and tensors
        assert getattr(from_gguf.config, switch) == getattr(from_dir.config, switch), switch
    return out


@pytest.mark.parametrize("name", NAMES)
def test_each_family_row_computes_transformers_logits(tmp_path, name):
    d = distances(name, tmp_path)
    print(name, {k: f"{v:.2e}" for k, v in d.items()})
    floor = max(d["transformers f32"], 1e-4)  # float32's own distance here, and at least the suite's logit bound
    assert d["llama-jax dir"] <= 2 * floor and d["llama-jax gguf"] <= 2 * floor, d


@pytest.mark.parametrize("name", NAMES)
def test_llama_cpp_runs_each_family_gguf_to_transformers_greedy_tokens(tmp_path, name):
    """llama.cpp itself (llama-cpp-python, built by `make bench`; skipped where it is not installed, as in `make
    test`) on each row's GGUF file, with a float32 KV cache: the same greedy tokens as transformers, its logits
    within 8x transformers' float32 distance from float64, floored at 1e-4 (ggml's own float32 arithmetic, which
    differs by build: up to 3x on a Zen 4; on an Intel Xeon with AVX-512, its build without AMX, 5.1x for
    mistral-7b-v0.3 and up to 3.8x elsewhere; llama-jax's rows are held to 2x). Its default f16 cache moves them by
    0.3-1.3% of the largest logit (0.026-0.29 here), 500-1000x float32's distance."""
    llama_cpp = pytest.importorskip("llama_cpp")
    hf, _, path, f64 = row(name, tmp_path)
    f32_cache = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32}
    llm = llama_cpp.Llama(str(path), n_ctx=len(IDS) + 16, logits_all=True, n_threads=2, verbose=False, **f32_cache)
    llm.eval(IDS)
    distance = float(np.abs(np.asarray(llm.scores[: len(IDS)]) - f64).max())
    f32 = float(np.abs(hf_logits(hf, IDS) - f64).max())
    llm.reset()
    llm.eval(IDS[:8])
    tokens = []
    for _ in range(12):
        tokens.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval(tokens[-1:])
    print(name, f"llama.cpp {distance:.2e}, transformers f32 {f32:.2e} from float64")
    assert tokens == hf_greedy(hf, IDS[:8], 12)
    assert distance <= 8 * max(f32, 1e-4)
