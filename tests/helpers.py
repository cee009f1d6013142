"""Helpers of the tests: the prompts of the default model's tests, builders of random Hugging Face checkpoints
through transformers itself (the numerical reference), transformers' logits and intermediates, a counter of a
jitted function's traces, and the f32-class rule's measures (a product's error against float64, a straight f32
sum's). Imported as `from tests.helpers import ...`, after conftest.py has installed the type
checks' import hook."""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
from pathlib import Path

import chex
import jax
import numpy as np

import llama_jax
from llama_jax.core.config import LlamaConfig
from llama_jax.runtime.cpu import cpu_flags
from llama_jax.testing import byte_tokenizer

# three prompts of at least 64 tokens each (SmolLM2's tokenizer), of different kinds of text
PROMPTS = [
    "The history of the Roman Empire spans many centuries, beginning with the founding of the city of Rome and"
    " ending with the fall of Constantinople in 1453. Over this long period the empire saw remarkable achievements"
    " in law, engineering, architecture, and government, as well as long stretches of civil war, plague and"
    " economic crisis that tested its institutions.",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    a, b = 0, 1\n    for _ in range(n):\n'
    "        a, b = b, a + b\n    return a\n\n\ndef is_prime(n):\n    if n < 2:\n        return False\n"
    "    for d in range(2, int(n ** 0.5) + 1):\n        if n % d == 0:\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nExplain in a few sentences why the sky is blue during the day and red or orange at sunset,"
    " as you would to a curious ten-year-old who loves science.<|im_end|>\n<|im_start|>assistant\n",
]


def suite_cache() -> Path:
    """The tests' own cache folder, kept between runs: $XDG_CACHE_HOME/llama-jax-tests (~/.cache/...)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llama-jax-tests"


# JAX's settings of its persistent compilation cache, as the environment gives them to a new process
COMPILATION_CACHE_ENV = (
    "JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "JAX_COMPILATION_CACHE_MAX_SIZE",
)  # fmt: skip
COMPILATION_CACHE_BYTES = 2 << 30  # past this at the start of a run, the folder starts again empty


def share_compilations() -> Path | None:
    """Switches JAX's persistent compilation cache on for this process and, through the environment, for every
    process it starts (the CLI runs, the servers, the examples, the children of the multi-device tests): a program
    any of them compiled, in this run or an earlier one, is read from disk instead of compiled again. Its key is
    the program itself (with jax's version and the compile options), so a change of llama-jax compiles again only
    the programs it changes. In suite_cache()/xla-<hash of the CPU's flags> (XLA compiles for the host CPU);
    LLAMA_JAX_TEST_COMPILATION_CACHE=off leaves it off, =DIR puts it in DIR. The folder, or None when off.

    Without JAX's eviction (max size -1): with a size set, every program written takes a lock shared by the
    processes and reads the size and time of every entry (thousands), which halved a 2-core run. Instead the
    process that starts the run (pytest's, not a worker's) empties the folder when it has grown past
    COMPILATION_CACHE_BYTES."""
    value = os.environ.get("LLAMA_JAX_TEST_COMPILATION_CACHE", "")
    if value.lower() in ("off", "0", "none"):
        return None
    flags = hashlib.sha256(" ".join(sorted(cpu_flags() or ())).encode()).hexdigest()[:12]
    folder = Path(value) if value else suite_cache() / f"xla-{flags}"
    starts_the_run = "PYTEST_XDIST_WORKER" not in os.environ and COMPILATION_CACHE_ENV[0] not in os.environ
    if starts_the_run and folder.is_dir() and sum(f.stat().st_size for f in folder.iterdir()) > COMPILATION_CACHE_BYTES:
        shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    settings = [str(folder), "0", "0", "-1"]
    os.environ.update(zip(COMPILATION_CACHE_ENV, settings, strict=True))
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", -1)
    return folder


def memory_mappings() -> tuple[int, int]:
    """This process's memory mappings, and Linux's limit on them (vm.max_map_count; 65530 where unreadable)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            count = sum(1 for _ in maps)
    except OSError:  # not Linux
        return 0, 65530
    try:
        limit = int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        limit = 65530
    return count, limit


def hf_from_config(config: LlamaConfig, seed: int = 0):
    """A random transformers model of this config (LlamaForCausalLM, or MistralForCausalLM for a sliding window;
    f32, eager), norms randomised too."""
    return hf_from_json(config.to_hf(), seed)


def hf_from_json(config_json: dict, seed: int = 0):
    """A random transformers model of a config.json's fields (its model_type's class; f32, eager), norms
    randomised too."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    hf_config = dict(config_json)
    hf_config = AutoConfig.for_model(hf_config.pop("model_type"), **hf_config, attn_implementation="eager")
    hf = AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return hf


def save_hf_checkpoint(directory: Path, hf, dtype: str = "float32", max_shard_size: str | None = None) -> Path:
    """`save_pretrained` in the given dtype (sharded if max_shard_size), plus a byte-level tokenizer.json."""
    import torch

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    hf.to(torch_dtype).save_pretrained(directory, **kwargs)
    hf.to(torch.float32)
    byte_tokenizer().save(directory / "tokenizer.json")
    return directory


def hf_logits(hf, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf(torch.tensor([list(ids)])).logits[0].float().numpy()


def hf_greedy(hf, ids, max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate` after ids: the new ids, no end-of-sequence stop."""
    import torch

    with torch.no_grad():
        x = torch.tensor([list(ids)])
        out = hf.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


def hf_activations(hf, ids) -> dict[str, np.ndarray]:
    """transformers' own intermediates of every layer, by the Act names (qn and kn where its attention has per-head
    norms), each [layers, T, width] (the pattern [layers, heads, T, T]): module hooks (the eager attention's weights
    for the pattern, the inputs of
    post_attention_layernorm and down_proj for mid and hidden), and a wrapper around apply_rotary_pos_emb for the
    rotated queries and keys."""
    import torch

    llama = sys.modules[type(hf.model.layers[0].self_attn).__module__]  # modeling_llama, modeling_mistral, ...
    normed = hasattr(hf.model.layers[0].self_attn, "q_norm")  # Qwen3's per-head norms: the sites qn, kn
    acts: dict[str, list] = {name: [] for name in llama_jax.ACT_NAMES if normed or name not in ("qn", "kn")}

    def flat(x):  # [1, heads, T, head] -> [T, heads·head]
        return x[0].transpose(0, 1).reshape(x.shape[2], -1)

    def out_hook(name):
        def hook(_module, _inputs, output):
            acts[name].append((output[0] if isinstance(output, tuple) else output)[0])

        return hook

    def fused_hook(names):  # Phi-3's qkv_proj output [1, T, qw + 2·kvw]: q, k, v by their widths
        def hook(module, _inputs, output):
            attn = next(layer.self_attn for layer in hf.model.layers if layer.self_attn.qkv_proj is module)
            q = attn.config.num_attention_heads * attn.head_dim
            kv = attn.num_key_value_heads * attn.head_dim
            for name, part in zip(names, output[0].split([q, kv, kv], dim=-1), strict=True):
                acts[name].append(part)

        return hook

    def heads_hook(name):  # a per-head norm's output [1, T, heads, head] -> [T, heads·head]
        def hook(_module, _inputs, output):
            acts[name].append(output[0].reshape(output.shape[1], -1))

        return hook

    def input_hook(name):
        def hook(_module, inputs):
            acts[name].append(inputs[0][0])

        return hook

    def pattern_hook(_module, _inputs, output):
        acts["pattern"].append(output[1][0])  # [heads, T, T]: the eager attention's softmax

    original = llama.apply_rotary_pos_emb

    def rope(q, k, cos, sin, *args, **kwargs):
        qr, kr = original(q, k, cos, sin, *args, **kwargs)
        acts["qr"].append(flat(qr))
        acts["kr"].append(flat(kr))
        return qr, kr

    handles = []
    for layer in hf.model.layers:
        attn = layer.self_attn
        fused = hasattr(attn, "qkv_proj")
        if fused:
            handles.append(attn.qkv_proj.register_forward_hook(fused_hook(("q", "k", "v"))))
        for name, module in [
            ("n1", layer.input_layernorm),
            *([] if fused else [("q", attn.q_proj), ("k", attn.k_proj), ("v", attn.v_proj)]),
            ("a", attn.o_proj),
            ("n2", layer.post_attention_layernorm),
            ("m", layer.mlp),
            ("y", layer),
        ]:
            handles.append(module.register_forward_hook(out_hook(name)))
        if normed:
            handles.append(attn.q_norm.register_forward_hook(heads_hook("qn")))
            handles.append(attn.k_norm.register_forward_hook(heads_hook("kn")))
        handles.append(attn.o_proj.register_forward_pre_hook(input_hook("attn")))
        handles.append(layer.post_attention_layernorm.register_forward_pre_hook(input_hook("mid")))
        handles.append(layer.mlp.down_proj.register_forward_pre_hook(input_hook("hidden")))
        handles.append(attn.register_forward_hook(pattern_hook))
    nf: list = []
    embeds: list = []
    handles.append(hf.model.norm.register_forward_hook(lambda _m, _i, o: nf.append(o[0])))
    handles.append(hf.model.embed_tokens.register_forward_hook(lambda _m, _i, o: embeds.append(o[0])))
    llama.apply_rotary_pos_emb = rope
    try:
        with torch.no_grad():
            logits = hf(torch.tensor([list(ids)])).logits[0]
    finally:
        llama.apply_rotary_pos_emb = original
        for h in handles:
            h.remove()
    out = {name: torch.stack(values).float().numpy() for name, values in acts.items()}
    out["nf"] = nf[0].float().numpy()
    out["embeds"] = embeds[0].float().numpy()
    out["logits"] = logits.float().numpy()
    return out


def count_traces(monkeypatch, module, name: str, options: dict, n: int) -> None:
    """Replaces module.name, a jitted function, by its body jitted with the same options under
    chex.assert_max_traces: tracing it more than n times (a recompilation) raises AssertionError."""
    chex.clear_trace_counter()
    body = getattr(module, name).__wrapped__
    monkeypatch.setattr(module, name, jax.jit(chex.assert_max_traces(body, n), **options))


# llama.cpp's own tokenizer vocabularies (vendor/llama.cpp/models/ggml-vocab-*.gguf, with test vectors .inp/.out)
# and real chat templates (models/templates/), as llama-cpp-python's source distribution ships them
LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"


def llama_cpp_models() -> Path:
    """The `models` folder of llama.cpp in llama-cpp-python's sdist (its vocabularies and templates), downloaded by
    pip once into the user's cache (XDG_CACHE_HOME) and kept there; fails the test where pip cannot fetch it."""
    import subprocess
    import tarfile
    import tempfile

    import pytest

    cache = suite_cache()
    target = cache / LLAMA_CPP_PYTHON.replace("==", "-")
    if target.is_dir():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        pip = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", "-d", tmp]
        done = subprocess.run([*pip, LLAMA_CPP_PYTHON], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.fail(f"pip could not download {LLAMA_CPP_PYTHON}'s sdist (llama.cpp's vocabularies): {done.stderr}")
        (sdist,) = Path(tmp).glob("*.tar.gz")
        extracted = Path(tmp) / "models"
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                _, found, rest = member.name.partition("/vendor/llama.cpp/models/")
                if found and member.isfile() and (rest.startswith("ggml-vocab-") or rest.startswith("templates/")):
                    member.name = rest
                    tar.extract(member, extracted, filter="data")
        try:
            extracted.rename(target)  # whole or not at all; a worker that got there first keeps its copy
        except OSError:
            if not target.is_dir():
                raise
    return target


def relative_error(got, exact: np.ndarray) -> float:
    """The normwise error of a product: ‖got - exact‖ / ‖exact‖ (Frobenius)."""
    return float(np.linalg.norm(np.asarray(got, np.float64) - exact) / np.linalg.norm(exact))


def straight_sum_error(a: np.ndarray, b: np.ndarray, exact: np.ndarray) -> float:
    """The error of a straight f32 sum of a · b (each product rounded, added in order), relative to the exact;
    at least 2⁻²² (two units of f32 rounding: below that, on a few short sums, the comparison is noise)."""
    terms = a[:, :, None].astype(np.float32) * b[None, :, :].astype(np.float32)  # [M, K, N]
    straight = np.cumsum(terms, axis=1, dtype=np.float32)[:, -1]  # [M, N]: sequential
    return max(relative_error(straight, exact), 2.0**-22)
