"""The KV cache: keys (after RoPE) and values of every layer, with a static capacity (the spec's KV<cap, t>).

`length` is the number of positions written (t); the capacity (cap) is the size of the slot axis, part of the
array's shape, so a jitted step compiles once per (batch, capacity). A write at a slot at or past the capacity is
refused: `dynamic_update_slice` would silently clamp it onto the last slot, which the spec's kv_room law rules out.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import checkify
from jaxtyping import Array, Float, Int

from llama_jax.config import LlamaConfig
from llama_jax.errors import CapacityError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values [L, B, K, S, H] (S = capacity) and the number of positions written so far."""

    k: Float[Array, "layers batch kv capacity head"]
    v: Float[Array, "layers batch kv capacity head"]
    length: Int[Array, ""]

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
            raise CapacityError(
                f"a KV cache needs a positive batch and capacity, got batch {batch}, capacity {capacity}"
            )
        shape = (config.layers, batch, config.kv, capacity, config.head)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((), jnp.int32))

    def assert_matches(self, config: LlamaConfig) -> None:
        """chex asserts that the cache fits the config: shapes [L, B, K, S, H], equal dtypes, an int32 length."""
        expected = (config.layers, self.batch, config.kv, self.capacity, config.head)
        chex.assert_shape([self.k, self.v], expected)
        chex.assert_trees_all_equal_dtypes(self.k, self.v)
        chex.assert_shape(self.length, ())
        chex.assert_type(self.length, jnp.int32)

    def check_room(self, n: int) -> None:
        """Raises CapacityError, before anything is written, unless n more positions fit (host-side check)."""
        length = int(self.length)
        if length + n > self.capacity:
            raise CapacityError(
                f"KV cache full: writing {n} position(s) after the {length} already written needs"
                f" {length + n} slots, but the capacity is {self.capacity}; make a cache with a larger capacity"
            )


def check_room_traced(cache: KVCache, n: int) -> None:
    """The same check inside jitted code, as a checkify check (the caller wraps the function in checkify)."""
    checkify.check(
        cache.length + n <= cache.capacity,
        "KV cache full: writing {n} position(s) after the {length} already written is past the capacity {cap}",
        n=jnp.int32(n),
        length=cache.length,
        cap=jnp.int32(cache.capacity),
    )


def write_layer(
    cache_k: Float[Array, "L B K S H"],
    cache_v: Float[Array, "L B K S H"],
    layer: Int[Array, ""],
    at: Int[Array, ""],
    k: Float[Array, "B K T H"],
    v: Float[Array, "B K T H"],
) -> tuple[Float[Array, "L B K S H"], Float[Array, "L B K S H"]]:
    """Layer `layer`'s keys and values of T positions written at slots at..at+T-1, in place when donated."""
    start = (layer, jnp.int32(0), jnp.int32(0), at, jnp.int32(0))
    cache_k = lax.dynamic_update_slice(cache_k, k[None].astype(cache_k.dtype), start)  # [L, B, K, S, H]
    cache_v = lax.dynamic_update_slice(cache_v, v[None].astype(cache_v.dtype), start)  # [L, B, K, S, H]
    return cache_k, cache_v
