"""The KV cache: keys (after RoPE) and values of every layer, with a static capacity (the spec's KV<cap, t>).

`length[b]` is the number of positions sequence b has written (its t): sequences of a batch may hold prompts of
different lengths, each at its own positions from 0 (padding never shifts a sequence's positions), and each
writes its next position at slot length[b]. The capacity (cap) is the size of the slot axis, part of the array's
shape, so a jitted step compiles once per (batch, capacity). A write at a slot at or past the capacity is
refused before it is made (`passes.checks.check_room`): `dynamic_update_slice` would silently clamp it onto the
last slot, which the spec's kv_room law rules out.

A model with a sliding window (Mistral's) never reads a key older than the window, so its cache can hold the window
only (`KVCache.window_only`, `ring`): position p at slot p mod W (W = the window), written over once the window
has passed it. Nothing is clamped or lost: a slot is overwritten only by the position W after it, which no query
from then on sees. Attention reads a ring through `ring_view` (its slots in position order, then the new block) or,
for a decode step's native kernel, in place (every slot written is inside the window).

Ring or linear is decided once, where a cache is made (`for_positions`); after that the cache answers what a pass
asks of it, whichever it is: where a block's queries sit among the slots they read (`queries`), a layer's keys
and values written and read (`write_and_read`), how far a decode step reads in place (`reach`), whether more
positions fit (`fits`) and how many slots a step attends to (`attention_window`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int

from llama_jax.core import arrays
from llama_jax.core.buckets import bucket
from llama_jax.core.config import LlamaConfig
from llama_jax.errors import InvalidArgumentError
from llama_jax.runtime.executables import persistent_jit

MIN_WINDOW = 256  # decode attends to at least this many slots: one compilation up to 256 positions


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values [L, B, K, S, H] (S = capacity) and the number of positions each sequence has written.
    ring (static): the slots hold the last S positions, position p at slot p mod S (S = the sliding window)."""

    k: Float[Array, arrays.CACHE.annotation]
    v: Float[Array, arrays.CACHE.annotation]
    length: Int[Array, " B"]
    ring: bool = dataclasses.field(default=False, metadata={"static": True})

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

    @classmethod
    def window_only(cls, config: LlamaConfig, batch: int, dtype: jnp.dtype = jnp.float32) -> KVCache:
        """A ring of the sliding window's slots (`ring`): room for any number of positions, holding the last
        window of them, all that attention reads."""
        if config.sliding_window is None:
            raise InvalidArgumentError(
                "a window-only KV cache needs a model with a sliding window; this one attends to every position"
                " (make a cache with KVCache.empty and the capacity the positions need)"
            )
        return dataclasses.replace(cls.empty(config, batch, config.sliding_window, dtype), ring=True)

    @classmethod
    def for_positions(cls, config: LlamaConfig, batch: int, capacity: int) -> KVCache:
        """The cache a pass of `capacity` positions per sequence needs: the window only where the model has a
        sliding window shorter than that (the one place this is decided), else `capacity` slots."""
        if config.sliding_window is not None and config.sliding_window < capacity:
            return cls.window_only(config, batch)
        return cls.empty(config, batch, capacity)

    def fits(self, n: int, slots: int | None = None) -> Array:
        """Whether n more positions after every sequence's fit in the first `slots` slots (the capacity by
        default), inside compiled code (on the host: `room`). A ring always has room: it holds the window, and
        a window of slots is never asked of it."""
        if self.ring:
            return jnp.bool_(True)
        return jnp.max(self.length) + n <= (self.capacity if slots is None else slots)

    def room(self, written: int) -> int | None:
        """The positions a sequence that has written `written` can still write; None for a ring: any number."""
        return None if self.ring else self.capacity - written

    def attention_window(self, written: int, new: int, minimum: int = MIN_WINDOW) -> int | None:
        """The cache slots a step writing `new` positions after the longest sequence's `written` attends to,
        bucketed (a power of two, at least `minimum`, at most the capacity) so that a growing cache compiles a
        few times, not once per length; None for a ring (read whole: it holds the window)."""
        return None if self.ring else bucket(max(written + new, minimum), self.capacity)

    def queries(self, positions: Int[Array, "B T"], window: int | None) -> tuple[Int[Array, "B T"], int]:
        """Where a block of queries at `positions` (from each sequence's length on) sits among the slots
        `write_and_read` gives it, and how many slots that is: a linear cache's slots are its positions, the
        first `window` of them (the capacity by default); a ring's view holds its positions in order from the
        oldest it holds (`ring_view`)."""
        if not self.ring:
            return positions, window or self.capacity
        t = positions.shape[1]
        held = jnp.minimum(self.length, self.capacity)  # [B]
        return held[:, None] + jnp.arange(t, dtype=jnp.int32), ring_view_slots(self.capacity, t)  # [B, T], R

    def write_and_read(
        self,
        layer: Int[Array, ""],
        k: Float[Array, "B K T H"],
        v: Float[Array, "B K T H"],
        real: Int[Array, " B"],
        window: int | None,
    ) -> tuple[KVCache, Float[Array, "B K S H"], Float[Array, "B K S H"]]:
        """This cache with layer `layer`'s keys and values of a block of T positions written from each sequence's
        length (the first real[b] of sequence b: a ring's padding would overwrite positions still in its
        window, a linear cache's is overwritten by its later writes), and the keys and values the block's queries
        attend to, at the slots `queries` says: a linear cache's first `window` slots (after the write), a
        ring's view (read before the block is written over the slots it may need)."""
        stacked = (self.k, self.v)
        if not self.ring:
            k_all, v_all = write_layer(*stacked, layer, self.length, k, v)  # [L, B, K, S, H] each
            keys, values = k_all[layer, :, :, :window], v_all[layer, :, :, :window]  # [B, K, W, H] each
        else:
            keys, values = ring_view(*stacked, layer, self.length, k, v)  # [B, K, R, H] each
            if k.shape[2] == 1:  # position p at slot p mod S
                k_all, v_all = write_layer(*stacked, layer, self.length % self.capacity, k, v)
            else:
                k_all, v_all = write_ring_layer(*stacked, layer, self.length, real, k, v)
        return dataclasses.replace(self, k=k_all, v=v_all), keys, values

    def reach(self, positions: Int[Array, " B"], sliding_window: int | None) -> tuple[Int[Array, " B"], int | None]:
        """What a decode step's kernel reads in place for one query per sequence at `positions`: the last slot
        (slots 0..last) and the window of them it keeps (None: all). A linear cache: up to the position, under
        the model's sliding window; a ring: its slots up to min(position, S - 1), each one inside the window."""
        if self.ring:
            return jnp.minimum(positions, self.capacity - 1), None
        return positions, sliding_window

    def with_length(self, length: Int[Array, " B"]) -> KVCache:
        """This cache's keys and values with these lengths."""
        return dataclasses.replace(self, length=length)

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


def ring_view_slots(capacity: int, new: int) -> int:
    """The slots of a ring's `ring_view` for a block of `new` positions: the power of two ≥ capacity + new."""
    return bucket(capacity + new)


def write_ring_layer(
    cache_k: Float[Array, "L B K S H"],
    cache_v: Float[Array, "L B K S H"],
    layer: Int[Array, ""],
    length: Int[Array, " B"],
    n: Int[Array, " B"],
    k: Float[Array, "B K T H"],
    v: Float[Array, "B K T H"],
) -> tuple[Float[Array, "L B K S H"], Float[Array, "L B K S H"]]:
    """Layer `layer` of a ring with the first n[b] of T new positions of sequence b written (from position
    length[b]), the rest padding and not written (a ring's padding would overwrite positions still in the window).
    Slot s takes the newest real position p ≡ s (mod S), block index j = p - length, where there is one: a gather
    and a select over the layer's S slots, whatever T."""
    s_, t = cache_k.shape[3], k.shape[2]
    last = length + n - 1  # [B]: each sequence's last real position
    j = (n - 1)[:, None] - (last[:, None] - jnp.arange(s_, dtype=jnp.int32)[None]) % s_  # [B, S]
    taken = (j >= 0)[:, None, :, None]  # [B, 1, S, 1]
    at = jnp.clip(j, 0, t - 1)[:, None, :, None]  # [B, 1, S, 1]

    def write(cache: Array, new: Array) -> Array:
        old = cache[layer]  # [B, K, S, H]
        picked = jnp.take_along_axis(new.astype(cache.dtype), at, axis=2)  # [B, K, S, H]
        return lax.dynamic_update_index_in_dim(cache, jnp.where(taken, picked, old), layer, 0)  # [L, B, K, S, H]

    return write(cache_k, k), write(cache_v, v)


def ring_view(
    cache_k: Float[Array, "L B K S H"],
    cache_v: Float[Array, "L B K S H"],
    layer: Int[Array, ""],
    length: Int[Array, " B"],
    k: Float[Array, "B K T H"],
    v: Float[Array, "B K T H"],
) -> tuple[Float[Array, "B K R H"], Float[Array, "B K R H"]]:
    """The keys and values a block of T new positions attends to, from a ring (before they are written) and the
    block: R slots in position order, slot r holding position base[b] + r (base: the oldest position the ring
    holds, max(length - S, 0)); past the block's last position, copies of it that a causal mask hides. A query at
    position p is then at slot p - base: the linear cache's layout, for the same masks and kernels. R is the power
    of two `ring_view_slots`: until the ring wraps (base 0) a row's attention is then the same bits as from a
    linear cache (whose windows are powers of two too, and trailing masked slots change no bit)."""
    s_, t = cache_k.shape[3], k.shape[2]
    held = jnp.minimum(length, s_)  # [B]: the positions the ring holds
    base = length - held  # [B]
    r = jnp.arange(ring_view_slots(s_, t), dtype=jnp.int32)[None]  # [1, R]
    source = jnp.where(r < held[:, None], (base[:, None] + r) % s_, s_ + jnp.clip(r - held[:, None], 0, t - 1))
    source = source[:, None, :, None]  # [B, 1, R, 1]: a slot of [ring | block]

    def view(cache: Array, new: Array) -> Array:
        both = jnp.concatenate([cache[layer], new.astype(cache.dtype)], axis=2)  # [B, K, S + T, H]
        return jnp.take_along_axis(both, source, axis=2)  # [B, K, R, H]

    return view(cache_k, k), view(cache_v, v)
