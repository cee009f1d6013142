"""Weights kept as a GGUF file stores them: ggml's blocks of 32 values (Q4_0, Q4_1, Q8_0), each a registered
pytree over one uint8 array of the raw blocks, so jit, scan over the layers, sharding and `tree.map` work on them
as on any array.

A block matrix [*layers, rows, cols] is held as blocks [*layers, rows, cols / 32, bytes], bytes as in the file
(f16 scales first, then the quants), read from it without conversion. `dequantize()` gives exactly the f32 values
the gguf package's reference dequantizer gives (ggml's order: `d * q`, then `+ m` for Q4_1, each rounded), which
are the values transformers loads from the file; the native decode kernels widen the blocks to the same values in
registers (`kernels`). Elsewhere (prefill, scoring, activations, gradients) a layer's matrices are dequantized
inside the layer loop, one layer at a time.

Axes in the package's alphabet (`core.config`): a matrix's O rows and I columns, Q = I / 32 blocks per row.
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

BLOCK = 32  # values per block, in every format here


@dataclasses.dataclass(frozen=True)
class Blocks(abc.ABC):
    """A matrix in one of ggml's block formats (a subclass per format). blocks: a jax or (while loading) numpy
    uint8 array [*layers, rows, cols / 32, BYTES]."""

    blocks: UInt8[Array, "*L O Q bytes"]
    GGML_TYPE: ClassVar[gguf.GGMLQuantizationType]
    BYTES: ClassVar[int]  # bytes per block
    SCALES: ClassVar[int] = 1  # f16 scales at the start of a block

    @property
    def format(self) -> str:
        return self.GGML_TYPE.name

    @property
    def shape(self) -> tuple[int, ...]:
        """The matrix's shape, [*layers, rows, cols]."""
        return (*self.blocks.shape[:-2], self.blocks.shape[-2] * BLOCK)

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.blocks.shape)) * self.blocks.dtype.itemsize

    @abc.abstractmethod
    def _values(self) -> Float[Array, "*A Q 32"]:
        """Each block's 32 values, in ggml's order of operations."""

    def dequantize(self) -> Float[Array, "*L O I"]:
        """The f32 values, exactly as gguf's dequantizer gives them."""
        values = self._values()  # [*L, rows, blocks, 32]
        return values.reshape(*values.shape[:-2], -1)  # [*L, rows, cols]

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
        blocks = np.asarray(self.blocks)
        scales = blocks[..., : 2 * self.SCALES].copy().view(np.uint16)
        return not ((scales & 0x7C00) == 0x7C00).any()


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
    SCALES: ClassVar = 2

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


FORMATS: dict[gguf.GGMLQuantizationType, type[Blocks]] = {f.GGML_TYPE: f for f in (Q4_0, Q4_1, Q8_0)}

Matrix = Float[Array, "..."] | Blocks  # a weight matrix as held: a float array (f32, bf16, f16) or blocks


def dense(w: Matrix) -> Float[Array, ...]:
    """A weight as a float array: blocks dequantized to f32, float arrays as they are (widened where used)."""
    return w.dequantize() if isinstance(w, Blocks) else w


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
