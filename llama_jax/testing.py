"""Tiny random models for fast tests and examples: configs of a few heads and layers, weights drawn from numpy,
and a byte-level tokenizer to go with them."""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from llama_jax.config import LlamaConfig
from llama_jax.tokenizer import Tokenizer
from llama_jax.weights import Weights, hf_shapes


def tiny_config(
    kv: int = 2, g: int = 2, half: int = 4, ffn: int = 24, layers: int = 2, vocab: int = 260, tied: bool = True
) -> LlamaConfig:
    """A model small enough to compile and run in well under a second."""
    return LlamaConfig(
        kv=kv, g=g, half=half, ffn=ffn, layers=layers, vocab=vocab, eps=1e-5, theta=10000.0, tied=tied, context=128
    )


def random_tensors(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint by Hugging Face name: matrices N(0, 0.2²), norm gains around 1 (f32)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in hf_shapes(config).items():
        if len(shape) == 1:
            tensors[name] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[name] = (0.2 * rng.standard_normal(shape)).astype(np.float32)
    return tensors


def random_weights(config: LlamaConfig, seed: int = 0, dtype: str = "float32") -> Weights:
    tensors = random_tensors(config, seed)
    return Weights.from_hf_tensors(config, {n: (lambda a=a: a) for n, a in tensors.items()}, "random", dtype)


def byte_tokenizer(extra_special: tuple[str, ...] = ("<eos>",)) -> Tokenizer:
    """A byte-level tokenizer with no merges: ids 0..255 are the bytes (in ByteLevel's alphabet order), then the
    special tokens. For random checkpoints of vocab ≥ 256 + len(extra_special)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = HFTokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(extra_special))
    return Tokenizer(backend)
