"""Weights kept as a GGUF file stores them: ggml's blocks of 32 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and its
k-quants' super-blocks of 256 (Q4_K, Q5_K, Q6_K), each a registered pytree over one uint8 array of the raw blocks,
so jit, scan over the layers, sharding and `tree.map` work on them as on any array.

A block matrix [*layers, rows, cols] is held as blocks [*layers, rows, cols / VALUES, BYTES], bytes as in the file,
read from it without conversion. `dequantize()` gives exactly the f32 values the gguf package's reference
dequantizer gives (ggml's order of operations: `d * q`, then `+ m` for Q4_1, each rounded; a k-quant's sub-block
scale `d * scale` first), which are the values transformers loads from the file; the native kernels widen the
blocks to the same values in registers (`kernels`), reading a layer where it lies in the stack (`HeldLayer`; a
float stack's layer: `SlicedLayer`).
Elsewhere (prefill, scoring, activations, gradients on XLA's path) a layer's matrices are dequantized inside the
layer loop, one layer at a time.

Axes in the package's alphabet (`core.config`): a matrix's O rows and I columns, Q = I / VALUES blocks per row.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import ClassVar

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike, Float, Int, UInt8

BLOCK = 32  # values per block of the legacy formats (Q4_0 .. Q8_0)
K_BLOCK = 256  # values per super-block of the k-quants


@dataclasses.dataclass(frozen=True)
class Blocks(abc.ABC):
    """A matrix in one of ggml's block formats (a subclass per format). blocks: a jax or (while loading) numpy
    uint8 array [*layers, rows, cols / 32, BYTES]."""

    blocks: UInt8[Array, "*L O Q bytes"]
    GGML_TYPE: ClassVar[gguf.GGMLQuantizationType]
    BYTES: ClassVar[int]  # bytes per block
    VALUES: ClassVar[int] = BLOCK  # values per block
    SCALES: ClassVar[tuple[int, ...]] = (0,)  # the byte offsets of its f16 scales

    @property
    def format(self) -> str:
        return self.GGML_TYPE.name

    @property
    def shape(self) -> tuple[int, ...]:
        """The matrix's shape, [*layers, rows, cols]."""
        return (*self.blocks.shape[:-2], self.blocks.shape[-2] * self.VALUES)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.blocks.shape)) * self.blocks.dtype.itemsize

    @abc.abstractmethod
    def _values(self) -> Float[Array, "*A Q VALUES"]:
        """Each block's values, in ggml's order of operations."""

    def dequantize(self) -> Float[Array, "*L O I"]:
        """The f32 values, exactly as gguf's dequantizer gives them."""
        values = self._values()  # [*L, rows, blocks, 32]
        return values.reshape(*values.shape[:-2], -1)  # [*L, rows, cols]

    def at(self, layer: Int[Array, ""]) -> HeldLayer:
        """Layer `layer` (traced: the layer loop's) of these stacked blocks, where it lies (`HeldLayer`)."""
        return HeldLayer((self,), jnp.zeros((), jnp.int32), jnp.asarray(layer, jnp.int32))

    def rows(self, index: Int[ArrayLike, "*A"]) -> Float[Array, "*A I"]:
        """Rows `index` of a [rows, cols] matrix, dequantized (an embedding lookup)."""
        return type(self)(self.blocks[index]).dequantize()

    def host_dequantize(self) -> np.ndarray:
        """The f32 values of numpy blocks, by the gguf package's own dequantizer (while loading)."""
        blocks = np.asarray(self.blocks)
        with np.errstate(invalid="ignore"):  # inf·0 of a corrupt scale: NaN, which the loader refuses by name
            values = gguf.quants.dequantize(blocks.reshape(-1), self.GGML_TYPE)
        return values.reshape(self.shape).astype(np.float32)

    def host_scales_finite(self) -> bool:
        """Whether every f16 scale of numpy blocks is finite (a non-finite one makes its whole block so)."""
        blocks = np.asarray(self.blocks)  # little-endian: a scale's exponent bits are 0x7C of its second byte
        return not any(((blocks[..., at + 1] & 0x7C) == 0x7C).any() for at in self.SCALES)


def _half(raw: UInt8[Array, "*A 2"]) -> Float[Array, "*A 1"]:
    """An f16 stored as two bytes, widened to f32 (exact)."""
    return lax.bitcast_convert_type(raw, jnp.float16).astype(jnp.float32)[..., None]


def _nibbles(qs: UInt8[Array, "*A 16"]) -> UInt8[Array, "*A 32"]:
    """ggml's nibble order: the low nibbles of the 16 bytes are values 0..15, the high ones 16..31."""
    return jnp.concatenate([qs & 0x0F, qs >> 4], axis=-1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q4_0(Blocks):
    """18-byte blocks: f16 d, 16 bytes of 4-bit q; value d · (q - 8)."""

    blocks: UInt8[Array, "*L O Q 18"]
    GGML_TYPE: ClassVar = gguf.GGMLQuantizationType.Q4_0
    BYTES: ClassVar = 18

    def _values(self) -> Float[Array, "*A Q 32"]:
        q = _nibbles(self.blocks[..., 2:]).astype(jnp.int8) - jnp.int8(8)  # [*lead, 32]
        return _half(self.blocks[..., 0:2]) * q.astype(jnp.float32)  # [*lead, 32]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q4_1(Blocks):
    """20-byte blocks: f16 d, f16 m, 16 bytes of 4-bit q; value d · q + m."""

    blocks: UInt8[Array, "*L O Q 20"]
    GGML_TYPE: ClassVar = gguf.GGMLQuantizationType.Q4_1
    BYTES: ClassVar = 20
    SCALES: ClassVar = (0, 2)

    def _values(self) -> Float[Array, "*A Q 32"]:
        q = _nibbles(self.blocks[..., 4:]).astype(jnp.float32)  # [*lead, 32]
        return _half(self.blocks[..., 0:2]) * q + _half(self.blocks[..., 2:4])  # [*lead, 32]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q8_0(Blocks):
    """34-byte blocks: f16 d, 32 int8 q; value q · d."""

    blocks: UInt8[Array, "*L O Q 34"]
    GGML_TYPE: ClassVar = gguf.GGMLQuantizationType.Q8_0
    BYTES: ClassVar = 34

    def _values(self) -> Float[Array, "*A Q 32"]:
        q = lax.bitcast_convert_type(self.blocks[..., 2:], jnp.int8).astype(jnp.float32)  # [*lead, 32]
        return q * _half(self.blocks[..., 0:2])  # [*lead, 32]


def _high_bits(qh: UInt8[Array, "*A 4"]) -> UInt8[Array, "*A 32"]:
    """A 5-bit block's fifth bits, 16 or 0: value j's is bit j of the little-endian 32-bit qh."""
    bits = (qh[..., :, None] >> jnp.arange(8, dtype=jnp.uint8)) & 1  # [*A, 4, 8]: byte b's bit i is value 8b + i's
    return bits.reshape(*qh.shape[:-1], 32) << 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q5_0(Blocks):
    """22-byte blocks: f16 d, 32 high bits, 16 bytes of nibbles; value d · (q - 16), q = nibble + 16 · high bit."""

    blocks: UInt8[Array, "*L O Q 22"]
    GGML_TYPE: ClassVar = gguf.GGMLQuantizationType.Q5_0
    BYTES: ClassVar = 22

    def _values(self) -> Float[Array, "*A Q 32"]:
        q = (_nibbles(self.blocks[..., 6:]) | _high_bits(self.blocks[..., 2:6])).astype(jnp.int8) - jnp.int8(16)
        return _half(self.blocks[..., 0:2]) * q.astype(jnp.float32)  # [*lead, 32]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q5_1(Blocks):
    """24-byte blocks: f16 d, f16 m, 32 high bits, 16 bytes of nibbles; value d · q + m."""

    blocks: UInt8[Array, "*L O Q 24"]
    GGML_TYPE: ClassVar = gguf.GGMLQuantizationType.Q5_1
    BYTES: ClassVar = 24
    SCALES: ClassVar = (0, 2)

    def _values(self) -> Float[Array, "*A Q 32"]:
        q = (_nibbles(self.blocks[..., 8:]) | _high_bits(self.blocks[..., 4:8])).astype(jnp.float32)  # [*lead, 32]
        return _half(self.blocks[..., 0:2]) * q + _half(self.blocks[..., 2:4])  # [*lead, 32]


def _k_values(blocks: UInt8[Array, "*A bytes"], q: UInt8[Array, "*A 8 32"]) -> Float[Array, "*A 256"]:
    """A Q4_K or Q5_K super-block's values from its quants q: sub-block j's (d · scale_j) · q - dmin · min_j, the
    eight 6-bit scales and mins packed in bytes 4..15 (ggml's get_scale_min_k4)."""
    s = blocks[..., 4:16]
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]  # [*A, 4] each
    scale = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1).astype(jnp.float32)  # [*A, 8]
    low = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1).astype(jnp.float32)  # [*A, 8]
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])  # [*A, 1] each
    values = (d * scale)[..., None] * q.astype(jnp.float32) - (dmin * low)[..., None]  # [*A, 8, 32]
    return values.reshape(*q.shape[:-2], K_BLOCK)  # [*A, 256]


def _k_nibbles(qs: UInt8[Array, "*A 128"]) -> UInt8[Array, "*A 8 32"]:
    """A k-quant's 256 nibbles as its 8 sub-blocks: 32 bytes per 64 values, the low nibbles then the high ones."""
    qs = qs.reshape(*qs.shape[:-1], 4, 1, 32) >> jnp.asarray([0, 4], jnp.uint8)[:, None]  # [*A, 4, 2, 32]
    return (qs & 0x0F).reshape(*qs.shape[:-3], 8, 32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q4_K(Blocks):
    """144-byte super-blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles; sub-block
    j's value (d · scale_j) · q - dmin · min_j."""

    blocks: UInt8[Array, "*L O Q 144"]
    GGML_TYPE: ClassVar = gguf.GGMLQuantizationType.Q4_K
    BYTES: ClassVar = 144
    VALUES: ClassVar = K_BLOCK
    SCALES: ClassVar = (0, 2)

    def _values(self) -> Float[Array, "*A Q 256"]:
        return _k_values(self.blocks, _k_nibbles(self.blocks[..., 16:]))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q5_K(Blocks):
    """176-byte super-blocks of 256: Q4_K's with 32 bytes of fifth bits after the scales (value l of sub-block j:
    bit j of byte l)."""

    blocks: UInt8[Array, "*L O Q 176"]
    GGML_TYPE: ClassVar = gguf.GGMLQuantizationType.Q5_K
    BYTES: ClassVar = 176
    VALUES: ClassVar = K_BLOCK
    SCALES: ClassVar = (0, 2)

    def _values(self) -> Float[Array, "*A Q 256"]:
        qh = self.blocks[..., None, 16:48] >> jnp.arange(8, dtype=jnp.uint8)[:, None]  # [*A, 8, 32]
        return _k_values(self.blocks, _k_nibbles(self.blocks[..., 48:]) | ((qh & 1) << 4))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q6_K(Blocks):
    """210-byte super-blocks of 256: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16
    values), f16 d; value (d · scale) · (q - 32)."""

    blocks: UInt8[Array, "*L O Q 210"]
    GGML_TYPE: ClassVar = gguf.GGMLQuantizationType.Q6_K
    BYTES: ClassVar = 210
    VALUES: ClassVar = K_BLOCK
    SCALES: ClassVar = (208,)

    def _values(self) -> Float[Array, "*A Q 256"]:
        b = self.blocks
        lead = b.shape[:-1]
        ql = b[..., :128].reshape(*lead, 2, 1, 64) >> jnp.asarray([0, 4], jnp.uint8)[:, None]  # [*A, 2, 2, 64]
        ql = (ql & 0x0F).reshape(*lead, 2, 4, 32)  # [*A, half, k, 32]
        qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> jnp.asarray([0, 2, 4, 6], jnp.uint8)[:, None]
        q = (ql | ((qh & 3) << 4)).astype(jnp.int8) - jnp.int8(32)  # [*A, 2, 4, 32]
        scale = lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)  # [*A, 16]
        d = _half(b[..., 208:210]) * scale  # [*A, 16]
        return (d[..., None] * q.reshape(*lead, 16, 16).astype(jnp.float32)).reshape(*lead, K_BLOCK)  # [*A, 256]


FORMATS: dict[gguf.GGMLQuantizationType, type[Blocks]] = {
    f.GGML_TYPE: f for f in (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)
}
BY_NAME: dict[str, type[Blocks]] = {f.GGML_TYPE.name: f for f in FORMATS.values()}  # `kind` -> its class

Matrix = Float[Array, "..."] | Blocks  # a weight matrix as held: a float array (f32, bf16, f16) or blocks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mixed:
    """A stacked matrix [L, O, I] whose layers the file holds in different kinds (a Q4_K_M file's ffn_down and
    attn_v mix Q4_K and Q6_K), each layer held as stored: one stack per kind (parts, each [L_k, ...] as that kind
    is held) and each layer's place (part, index), static. The layer loop computes a layer on its part's product,
    read at its index (`HeldLayer`)."""

    parts: tuple[Matrix, ...]
    places: tuple[tuple[int, int], ...] = dataclasses.field(metadata={"static": True})

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.places), *self.parts[0].shape[1:])

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def layer(self, i: int) -> Matrix:
        """Layer i as held."""
        part, index = self.places[i]
        return jax.tree.map(lambda a: a[index], self.parts[part])

    def dequantize(self) -> Float[Array, "L O I"]:
        """Every layer's f32 values, stacked in layer order."""
        return jnp.stack([dense(self.layer(i)).astype(jnp.float32) for i in range(len(self.places))])

    def at(self, layer: Int[Array, ""]) -> HeldLayer:
        """Layer `layer` (traced: the layer loop's) as a `HeldLayer`."""
        part, index = (jnp.asarray(column, jnp.int32)[layer] for column in zip(*self.places, strict=True))
        return HeldLayer(self.parts, part, index)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeldLayer:
    """One layer of stacked blocks inside the layer loop, not sliced out of the stack: the stacks (one, or a
    `Mixed`'s parts) and which one holds this layer, where (traced). The native product reads the layer in place; a
    slice (the layer loop's scan over the stack) is a copy, which holds a whole layer's weights in temporary memory
    and writes them again at every pass."""

    parts: tuple[Matrix, ...]
    part: Int[Array, ""]
    index: Int[Array, ""]

    def take(self) -> Matrix:
        """A copy of this layer, read from its only part."""
        return jax.tree.map(lambda a: a[self.index], self.parts[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlicedLayer:
    """One layer of stacked float weights inside the layer loop: the loop's own slice of the stack, which a weight
    gradient flows to, beside the stack and the layer's index (traced). The native product reads the layer in
    place in the stack, so the slice is never read and never copied (a slice is a copy of the layer, made again in
    a gradient's backward pass)."""

    piece: Float[Array, "O I"]
    stack: Float[Array, "L O I"]
    index: Int[Array, ""]


def dense(w: Matrix | Mixed | HeldLayer | SlicedLayer) -> Float[Array, ...]:
    """A weight as a float array: blocks dequantized to f32, float arrays as they are (widened where used); a
    layer in place (of one part) as a copy of it."""
    if isinstance(w, HeldLayer):
        return dense(w.take())
    if isinstance(w, SlicedLayer):
        return w.piece
    return w.dequantize() if isinstance(w, (Blocks, Mixed)) else w


def take_rows(w: Matrix, index: Int[ArrayLike, "*A"]) -> Float[Array, "*A I"]:
    """Rows `index` of a [rows, cols] weight (the embedding lookup), as floats. A bf16 or f16 table is gathered as
    its bits: for a 16-bit float gather XLA's CPU backend widens the whole table to f32 first, on every call (113 MB
    written each decode step for SmolLM2-135M's bf16 embedding)."""
    if isinstance(w, Blocks):
        return w.rows(index)
    if w.dtype.itemsize == 2 and jnp.issubdtype(w.dtype, jnp.floating):
        return lax.bitcast_convert_type(lax.bitcast_convert_type(w, jnp.uint16)[index], w.dtype)
    return w[index]


def compute_dtype(w: Matrix) -> jnp.dtype:
    """The dtype a weight is computed in: f32 for blocks and narrower floats, f64 for f64 (gradient checks)."""
    return jnp.promote_types(jnp.float32 if isinstance(w, Blocks) else w.dtype, jnp.float32)


def kind(w: Matrix) -> str:
    """How a weight is held: a block format's name (Q4_1) or a float dtype's (float32)."""
    return w.format if isinstance(w, Blocks) else str(w.dtype)
