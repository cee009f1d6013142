"""Tiny random models for fast tests and examples: configs of a few heads and layers, weights drawn from numpy,
and a byte-level tokenizer to go with them; and the helpers the tests compare the model with (greedy decoding,
attention without its pattern)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jaxtyping import Array, Bool, Float
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from llama_jax.core.config import LlamaConfig
from llama_jax.core.weights import Weights
from llama_jax.loaders.checkpoint import Checkpoint
from llama_jax.loaders.tensors import hf_shapes, weights_from_tensors
from llama_jax.model import Model
from llama_jax.nn.attention import attention_with_pattern
from llama_jax.passes.generate import token_steps
from llama_jax.text.tokenizer import Tokenizer


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
    return weights_from_tensors(config, {n: (lambda a=a: a) for n, a in tensors.items()}, "random", dtype)


def tiny_model(
    config: LlamaConfig | None = None, seed: int = 3, native: str | None = None, weights: Weights | None = None
) -> Model:
    """A Model of random weights (f32; or the weights given) with the byte tokenizer (end of sequence: id 256);
    default config `tiny_config()`. native: as for `load`."""
    config = tiny_config() if config is None else config
    weights = random_weights(config, seed) if weights is None else weights
    checkpoint = Checkpoint(config, weights, byte_tokenizer(), None, (256,), "tiny")
    return Model(checkpoint, None, native)


def byte_tokenizer(extra_special: tuple[str, ...] = ("<eos>",)) -> Tokenizer:
    """A byte-level tokenizer with no merges: ids 0..255 are the bytes (in ByteLevel's alphabet order), then the
    special tokens. For random checkpoints of vocab ≥ 256 + len(extra_special)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = HFTokenizer(models.BPE({ch: i for i, ch in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(extra_special))
    return Tokenizer(backend)


def greedy(
    weights: Weights,
    config: LlamaConfig,
    ids: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    native: bool = False,
) -> list[int]:
    """The new ids after `ids` by the generation loop, each the argmax of its logits (the lowest id on ties),
    ending with the first end-of-sequence id if one comes before max_new_tokens: what transformers' greedy
    `generate` is compared with. native: decode with the native kernels (a Model's `native.active`)."""
    new: list[int] = []
    for step in token_steps(weights, config, [ids], max_new_tokens, native=native):
        new.append(int(step[0]))
        if new[-1] in eos_ids:
            break
    return new


def attention(
    q: Float[Array, "B T N H"], k: Float[Array, "B K S H"], v: Float[Array, "B K S H"], mask: Bool[Array, "B T S"]
) -> Float[Array, "B T N H"]:
    """The model's attention without its pattern (`nn.attention.attention_with_pattern`), as the kernels' and the
    laws' tests compare it."""
    return attention_with_pattern(q, k, v, mask)[0]
