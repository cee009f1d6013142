"""Writes small GGUF files the way llama.cpp's convert_hf_to_gguf.py does: the family's architecture and keys,
tensors by GGUF name, q and k rows permuted where it permutes them (llama.cpp's `permute`), matrices quantized to a
chosen GGML type, norms and biases in F32."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tokenizers import pre_tokenizers

from llama_jax.core import arrays
from llama_jax.core.config import LlamaConfig
from llama_jax.core.quantized import FORMATS
from llama_jax.loaders.checkpoint import GGUF_PERMUTED, hf_name

_PARTS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
_NAMES = ["token_embd.weight", "output_norm.weight", "output.weight"]
_NAMES += [f"blk.{i}.{part}.weight" for i in range(8) for part in (*_PARTS, "attn_q_norm", "attn_k_norm")]
_NAMES += [arrays.LAYER[f"{m}_bias"].gguf.format(i) for i in range(8) for m in arrays.LAYER_MATRICES]
GGUF_NAME = {hf_name(name): name for name in _NAMES}  # Hugging Face name -> GGUF name
GGUF_NAME |= {hf.format(i): gguf_name.format(i) for hf, gguf_name, _ in arrays.FUSED for i in range(8)}  # Phi-3's


def gguf_arch(config: LlamaConfig) -> str:
    """The GGUF architecture llama.cpp's converter writes a family as (Mistral's as llama)."""
    return "llama" if config.family == "mistral" else config.family


def gguf_metadata(config: LlamaConfig) -> dict[str, Any]:
    """The metadata LlamaConfig.from_gguf and Tokenizer.from_gguf read, under the family's architecture (Granite's
    scalars as its converter writes them): a byte-level BPE vocabulary (the 256 ByteLevel characters, <eos>, one
    merge, padding)."""
    tokens = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "<eos>", "Ġt"]
    tokens += [f"<pad{i}>" for i in range(config.vocab - len(tokens))]
    p = f"{gguf_arch(config)}."
    longrope = {  # Phi-3's, beside its rope_factors tensors
        p + "rope.scaling.attn_factor": config.rope.attention_factor,
        p + "rope.scaling.original_context_length": config.rope.original_context,
    }
    granite = {
        p + "embedding_scale": config.embedding_multiplier,
        p + "residual_scale": config.residual_multiplier,
        p + "attention.scale": config.attention_scale,
        p + "logit_scale": config.logits_scaling,
    }
    return {
        p + "block_count": config.layers,
        p + "embedding_length": config.dim,
        p + "feed_forward_length": config.ffn,
        p + "attention.head_count": config.heads,
        p + "attention.head_count_kv": config.kv,
        p + "attention.layer_norm_rms_epsilon": config.eps,
        p + "rope.freq_base": config.theta,
        p + "rope.dimension_count": config.head_dim,
        p + "context_length": config.context,
        # llama.cpp's converter writes the head size where a config.json gives head_dim (here: where it is not
        # dim / heads)
        **({} if config.dim == config.qw else {p + "attention.key_length": config.head_dim}),
        **({} if config.dim == config.qw else {p + "attention.value_length": config.head_dim}),
        **(granite if config.family == "granite" else {}),
        **({p + "attention.sliding_window": config.sliding_window or 0} if config.family == "phi3" else {}),
        **(longrope if config.rope.kind == "longrope" else {}),
        p + "vocab_size": config.vocab,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 256 + [3] + [1] * (len(tokens) - 257),
        "tokenizer.ggml.merges": ["Ġ t"],
        "tokenizer.ggml.eos_token_id": 256,
    }


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's permute: within each head, the two halves' rows interleaved pairwise."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(shape: tuple[int, int], ggml_type: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    """A [rows, cols] tensor of ggml_type as random bytes, each below 0x34, so that every f16 field of a block (a
    scale, a minimum) is finite and below 0.5 in size: valid blocks of any type, whatever its layout."""
    block, size = gguf.GGML_QUANT_SIZES[ggml_type]
    rows, cols = shape
    return np.random.default_rng(seed).integers(0, 0x34, (rows, cols // block * size), dtype=np.uint8)


def blocks_of_size(shape: tuple[int, int], ggml_type: gguf.GGMLQuantizationType, std: float, seed: int) -> np.ndarray:
    """A [rows, cols] tensor of ggml_type as random blocks (`finite_blocks`) whose values have about the root mean
    square std: a stand-in for an array gguf-py cannot quantize, of the size of the array's values (random bytes'
    scales give values in the hundreds, through which a model's gradients are noise)."""
    fmt, (rows, cols) = FORMATS[ggml_type], shape
    unit = finite_blocks(fmt, (rows, cols // fmt.VALUES), np.random.default_rng(seed), 1.0)
    rms = float(np.sqrt(np.mean(np.square(gguf.quants.dequantize(unit.reshape(-1), ggml_type)))))
    blocks = finite_blocks(fmt, (rows, cols // fmt.VALUES), np.random.default_rng(seed), std / rms)
    return blocks.reshape(rows, -1)


def finite_blocks(fmt: type, lead: tuple[int, ...], rng: np.random.Generator, scale: float) -> np.ndarray:
    """Random blocks of a `quantized` format, [*lead, BYTES]: any quants and sub-block scales, and each f16 field
    (d, m, dmin) uniform in ±scale, so that every value is finite."""
    blocks = rng.integers(0, 256, (*lead, fmt.BYTES), dtype=np.uint8)
    for at in fmt.SCALES:
        blocks[..., at : at + 2] = rng.uniform(-scale, scale, lead).astype(np.float16)[..., None].view(np.uint8)
    return blocks


def write_gguf(
    path: Path,
    config: LlamaConfig,
    tensors: dict[str, np.ndarray],
    ggml_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
    rope_freqs: np.ndarray | None = None,
    types: dict[str, gguf.GGMLQuantizationType] | None = None,
    **meta: Any,
) -> Path:
    """A GGUF file of a checkpoint given by Hugging Face names, as llama.cpp converts one: its family's
    architecture, q/k (and their biases) permuted where llama.cpp's converter permutes them (`GGUF_PERMUTED`),
    2-D tensors stored as ggml_type (or as `types` gives for a GGUF name: a Q4_K_M file's mix), norms and biases
    F32, and rope_freqs (RoPE's frequency divisors, F32) if given. `meta` changes metadata keys (dots as "__"; None
    drops one)."""
    metadata = gguf_metadata(config) | {key.replace("__", "."): value for key, value in meta.items()}
    writer = gguf.GGUFWriter(str(path), gguf_arch(config))
    permuted = config.family in GGUF_PERMUTED
    for key, value in metadata.items():
        if value is not None:
            vtype = gguf.GGUFValueType.UINT32 if type(value) is int else gguf.GGUFValueType.get_type(value)
            writer.add_key_value(key, value, vtype)
    for name, array in tensors.items():
        if permuted and name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            array = llama_cpp_permute(array, config.heads)
        elif permuted and name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            array = llama_cpp_permute(array, config.kv)
        stored_as = (types or {}).get(GGUF_NAME[name], ggml_type)
        if array.ndim == 2 and stored_as != gguf.GGMLQuantizationType.F32:
            try:
                blocks = gguf.quants.quantize(array, stored_as)
            except NotImplementedError:  # gguf-py dequantizes k- and i-quants but does not quantize them
                blocks = (
                    blocks_of_size(array.shape, stored_as, float(np.std(array)), seed=len(name))
                    if stored_as in FORMATS  # a kind llama-jax holds as stored: values of the array's size
                    else random_blocks(array.shape, stored_as, seed=len(name))
                )
            writer.add_tensor(GGUF_NAME[name], blocks, raw_dtype=stored_as)
        else:
            writer.add_tensor(GGUF_NAME[name], array.astype(np.float32))
    if rope_freqs is not None:
        writer.add_tensor(arrays.ROPE_FREQS, np.asarray(rope_freqs, np.float32))
    if config.rope.kind == "longrope":
        for name, factors in zip(arrays.ROPE_FACTORS, (config.rope.short_factor, config.rope.long_factor), strict=True):
            writer.add_tensor(name, np.asarray(factors, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def llama3_rope_freqs(config: LlamaConfig) -> np.ndarray:
    """The `rope_freqs.weight` llama.cpp's convert_hf_to_gguf.py writes for a llama3 scaling: per frequency, 1
    (kept), the factor (scaled) or the smooth band's 1 / ((1 - s) / factor + s), in Python floats, stored f32."""
    r = config.rope
    freqs = 1.0 / (np.float32(config.theta) ** (np.arange(0, config.head_dim, 2, dtype=np.float32) / config.head_dim))
    low, high = r.original_context / r.low_freq_factor, r.original_context / r.high_freq_factor
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high:
            factors.append(1.0)
        elif wavelen > low:
            factors.append(r.factor)
        else:
            smooth = (r.original_context / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
            factors.append(1 / ((1 - smooth) / r.factor + smooth))
    return np.asarray(factors, np.float32)
