"""Running across devices with JAX's own sharding: a Mesh with a "data" axis and a "model" axis.

- Data parallelism: a batch's rows are split over "data" (scoring; generation of a batch).
- Weight sharding (Megatron's split): attention by heads (q, k, v by their output rows, o by its input columns)
  and the MLP by its inner width (gate, up by rows, down by columns) over "model"; embeddings and norms are
  replicated. A part whose size the model axis does not divide (SmolLM2-135M's 9 heads over 4 devices) is
  replicated, not split unevenly. The KV cache is split like the keys: batch over "data", kv heads over "model".

The passes themselves do not change: jit compiles them for the shardings of their inputs (GSPMD), on one CPU,
on several (XLA_FLAGS=--xla_force_host_platform_device_count=8), on accelerators, and across hosts after
`jax.distributed.initialize()`.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llama_jax.cache import KVCache
from llama_jax.config import LlamaConfig
from llama_jax.errors import ShardingError
from llama_jax.weights import LayerWeights, Weights

DATA, MODEL = "data", "model"


def make_mesh(data: int | None = None, model: int = 1, devices: list | None = None) -> Mesh:
    """A (data, model) mesh over the devices (default: all); data defaults to the devices left after model."""
    devices = list(jax.devices() if devices is None else devices)
    if model < 1 or len(devices) % model:
        raise ShardingError(f"a model axis of {model} does not divide the {len(devices)} devices")
    data = len(devices) // model if data is None else data
    if data < 1 or data * model > len(devices):
        raise ShardingError(f"a mesh of data {data} x model {model} needs {data * model} devices; {len(devices)} here")
    return Mesh(np.array(devices[: data * model]).reshape(data, model), (DATA, MODEL))


def weight_specs(config: LlamaConfig, mesh: Mesh) -> Weights:
    """The PartitionSpec of every weight (a Weights pytree of specs)."""
    m = mesh.shape[MODEL]
    heads = MODEL if config.heads % m == 0 and config.kv % m == 0 else None
    ffn = MODEL if config.ffn % m == 0 else None
    layers = LayerWeights(
        ln1=P(),
        q=P(None, heads, None),
        k=P(None, heads, None),
        v=P(None, heads, None),
        o=P(None, None, heads),
        ln2=P(),
        gate=P(None, ffn, None),
        up=P(None, ffn, None),
        down=P(None, None, ffn),
    )
    return Weights(emb=P(), layers=layers, lnf=P(), lm_head=None if config.tied else P())


def shard_weights(weights: Weights, config: LlamaConfig, mesh: Mesh) -> Weights:
    """The weights placed on the mesh's devices, split as weight_specs says."""
    specs = weight_specs(config, mesh)
    return jax.tree.map(lambda w, spec: jax.device_put(w, NamedSharding(mesh, spec)), weights, specs)


def cache_spec(config: LlamaConfig, batch: int, mesh: Mesh) -> P:
    """[L, B, K, S, H]: the batch over data (when it divides), the kv heads over model (as the k and v weights)."""
    data = DATA if batch % mesh.shape[DATA] == 0 else None
    heads = MODEL if config.heads % mesh.shape[MODEL] == 0 and config.kv % mesh.shape[MODEL] == 0 else None
    return P(None, data, heads, None, None)


def shard_cache(cache: KVCache, config: LlamaConfig, mesh: Mesh) -> KVCache:
    kv = NamedSharding(mesh, cache_spec(config, cache.batch, mesh))
    return KVCache(
        jax.device_put(cache.k, kv), jax.device_put(cache.v, kv), jax.device_put(cache.length, NamedSharding(mesh, P()))
    )


def place_batch(block: np.ndarray, mesh: Mesh) -> jax.Array:
    """A [B, T] batch of ids with its rows split over the data axis (B must be a multiple of its size)."""
    if block.shape[0] % mesh.shape[DATA]:
        raise ShardingError(
            f"a batch of {block.shape[0]} rows does not split over a data axis of {mesh.shape[DATA]} devices;"
            " use a batch size that is a multiple of it"
        )
    return jax.device_put(block, NamedSharding(mesh, P(DATA, None)))
