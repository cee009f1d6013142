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

import dataclasses

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from llama_jax.core import arrays
from llama_jax.core.config import LlamaConfig
from llama_jax.core.kv_cache import KVCache
from llama_jax.core.quantized import Blocks, Mixed
from llama_jax.core.weights import LayerWeights, Weights
from llama_jax.errors import ShardingError

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


def _spec(spec: arrays.ArraySpec, config: LlamaConfig, mesh: Mesh | AbstractMesh) -> P:
    """An array's PartitionSpec: its split axis over the model axis where that divides its unit, else none."""
    axes: list[str | None] = [None] * len(spec.axes)
    if spec.split is not None and arrays.splits(spec.split[1], config, mesh.shape[MODEL]):
        axes[spec.split[0]] = MODEL
    return P(*axes)


def weight_specs(config: LlamaConfig, mesh: Mesh | AbstractMesh) -> Weights:
    """The PartitionSpec of every weight (a Weights pytree of specs), as `arrays` describes each (only the mesh's
    axis sizes matter: an AbstractMesh will do)."""
    present = {field: spec for field, spec in arrays.LAYER.items() if spec.present(config)}
    layers = LayerWeights(**{field: _spec(spec, config, mesh) for field, spec in present.items()})
    model = {field: _spec(spec, config, mesh) for field, spec in arrays.MODEL.items()}
    return Weights(emb=model["emb"], layers=layers, lnf=model["lnf"], lm_head=None if config.tied else model["lm_head"])


def shard_weights(weights: Weights, config: LlamaConfig, mesh: Mesh) -> Weights:
    """The weights placed on the mesh's devices, split as weight_specs says (blocks: their matrix's rows, or its
    columns a whole number of blocks at a time, else replicated; a `Mixed` matrix replicated)."""

    def place(spec: P, w: jax.Array | Blocks | Mixed) -> jax.Array | Blocks | Mixed:
        if isinstance(w, Mixed):  # layers in several stacks: each replicated
            return jax.device_put(w, NamedSharding(mesh, P()))
        if not isinstance(w, Blocks):
            return jax.device_put(w, NamedSharding(mesh, spec))
        axes = [*spec, None]  # [*layers, rows, blocks, bytes]: the matrix's columns are whole blocks
        if axes[-2] == MODEL and w.blocks.shape[-2] % mesh.shape[MODEL]:
            axes[-2] = None
        return type(w)(jax.device_put(w.blocks, NamedSharding(mesh, P(*axes))))

    return jax.tree.map(place, weight_specs(config, mesh), weights, is_leaf=lambda x: isinstance(x, P))


def cache_spec(config: LlamaConfig, batch: int, mesh: Mesh | AbstractMesh) -> P:
    """[L, B, K, S, H]: the kv heads over model (as the k and v weights), the batch over data (when it divides)."""
    axes = list(_spec(arrays.CACHE, config, mesh))
    if batch % mesh.shape[DATA] == 0:
        axes[arrays.CACHE_DATA_AXIS] = DATA
    return P(*axes)


def shard_cache(cache: KVCache, config: LlamaConfig, mesh: Mesh) -> KVCache:
    placed = NamedSharding(mesh, cache_spec(config, cache.batch, mesh))
    length = jax.device_put(cache.length, NamedSharding(mesh, P()))
    k, v = jax.device_put(cache.k, placed), jax.device_put(cache.v, placed)
    return dataclasses.replace(cache, k=k, v=v, length=length)


def place_batch(block: np.ndarray, mesh: Mesh) -> jax.Array:
    """A [B, T] batch of ids with its rows split over the data axis (B must be a multiple of its size)."""
    if block.shape[0] % mesh.shape[DATA]:
        raise ShardingError(
            f"a batch of {block.shape[0]} rows does not split over a data axis of {mesh.shape[DATA]} devices;"
            " use a batch size that is a multiple of it"
        )
    return jax.device_put(block, NamedSharding(mesh, P(DATA, None)))


def to_host(x: jax.Array) -> np.ndarray:
    """An array's values as numpy, whole in every process: gathered from the other processes where they hold some
    of its shards (every process must call it then, as each runs the computation)."""
    return np.asarray(x) if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True)
