"""The KV cache: keys (after RoPE) and values of every layer, with a static capacity (the spec's KV<cap, t>).

`length[b]` is the number of positions sequence b has written (its t): sequences of a batch may hold prompts of
different lengths, each at its own positions from 0 (padding never shifts a sequence's positions), and each
writes its next position at slot length[b]. The capacity (cap) is the size of the slot axis, part of the array's
shape, so a jitted step compiles once per (batch, capacity). A write at a slot at or past the capacity is
refused before it is made (`passes.checks.check_room`): `dynamic_update_slice` would silently clamp it onto the
last slot, which the spec's kv_room law rules out.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from llama_jax.core import arrays
from llama_jax.core.config import LlamaConfig
from llama_jax.errors import InvalidArgumentError
from llama_jax.runtime.executables import persistent_jit


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values [L, B, K, S, H] (S = capacity) and the number of positions each sequence has written."""

    k: Float[Array, arrays.CACHE.annotation]
    v: Float[Array, arrays.CACHE.annotation]
    length: Int[Array, " B"]

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @classmethod
    def empty(cls, config: LlamaConfig, batch: int, capacity: int, dtype: jnp.dtype = jnp.float32) -> KVCache:
        """A cache with no position yet and room for `capacity` positions per sequence."""
        if capacity < 1 or batch < 1:
            raise InvalidArgumentError(
                f"a KV cache needs a positive batch and capacity, got batch {batch}, capacity {capacity}"
            )
        k, v, length = _zeros(arrays.CACHE.shape(config, batch=batch, capacity=capacity), jnp.dtype(dtype))
        return cls(k, v, length)

    def assert_matches(self, config: LlamaConfig) -> None:
        """chex asserts that the cache fits the config: shapes [L, B, K, S, H], equal dtypes, int32 lengths [B]."""
        import chex  # here, not at import: it pulls in absl, unittest and pdb (~6 MB), and only tracing needs it

        expected = arrays.CACHE.shape(config, batch=self.batch, capacity=self.capacity)
        chex.assert_shape([self.k, self.v], expected)
        chex.assert_trees_all_equal_dtypes(self.k, self.v)
        chex.assert_shape(self.length, (self.batch,))
        chex.assert_type(self.length, jnp.int32)


@persistent_jit(static_argnames=("shape", "dtype"))
def _zeros(shape: tuple[int, ...], dtype: jnp.dtype) -> tuple[Array, Array, Array]:
    """An empty cache's keys, values and lengths, by a program kept on disk (`runtime.executables`): a warm process
    loads it where jnp.zeros would compile its own (~20 MB of the first token's peak RSS)."""
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros(shape[1], jnp.int32)


def write_layer(
    cache_k: Float[Array, "L B K S H"],
    cache_v: Float[Array, "L B K S H"],
    layer: Int[Array, ""],
    at: Int[Array, " B"],
    k: Float[Array, "B K T H"],
    v: Float[Array, "B K T H"],
) -> tuple[Float[Array, "L B K S H"], Float[Array, "L B K S H"]]:
    """Layer `layer`'s keys and values of T positions of sequence b written at slots at[b]..at[b]+T-1, one
    dynamic_update_slice per sequence (in place when the cache is donated)."""
    zero = jnp.int32(0)
    for b in range(k.shape[0]):  # B is static and small; each sequence writes where its own positions are
        start = (layer, jnp.int32(b), zero, at[b], zero)
        cache_k = lax.dynamic_update_slice(cache_k, k[None, b : b + 1].astype(cache_k.dtype), start)
        cache_v = lax.dynamic_update_slice(cache_v, v[None, b : b + 1].astype(cache_v.dtype), start)
    return cache_k, cache_v  # [L, B, K, S, H] each
