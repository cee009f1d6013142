"""A reader of llama.cpp's GGUF format (versions 2 and 3) that trusts nothing in the file.

Every length, count and offset is checked against the file's size before it is used, so a truncated or corrupt
file raises a `CorruptFileError` subclass naming the file, the byte and the field, never a struct.error, a
MemoryError or a hang. The header is read through mmap, tensor data with plain reads. `read_stored` gives a
tensor as stored (F32, F16, BF16 arrays; the `quantized.FORMATS` as blocks); `read` dequantizes to f32 by
the gguf package's own routines (the ones transformers uses too): every type they dequantize, F32, F16, BF16, the
legacy quants (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), the k-quants (Q2_K to Q6_K), the i-quants and the ternary and FP4
types (SUPPORTED_TYPES; the others are listed by name in the error).

Layout: magic "GGUF", u32 version, u64 tensor count, u64 metadata count, the metadata (key, u32 type, value), the
tensor infos (name, u32 n_dims, u64 dims (innermost first), u32 type, u64 offset), then the data, aligned to
general.alignment (32 by default). All little-endian. As llama.cpp requires, each tensor's data follows the one
before it in header order (the first at offset 0, each padded to the alignment); and the file ends with the last
tensor's data or its padding, as every GGUF writer leaves it (stricter than llama.cpp, so that a changed type or
shape of the last tensor cannot go unnoticed). A tensor of a type llama-jax does not dequantize is refused as the
header is read; non-finite values are refused as the weights are read (`Weights`).
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path
from typing import Any

import gguf
import ml_dtypes
import numpy as np

from llama_jax.core.quantized import FORMATS, Blocks
from llama_jax.errors import (
    CheckpointNotFoundError,
    CorruptFileError,
    TensorSpanError,
    TruncatedFileError,
    UnsupportedDTypeError,
)

_SCALARS = {  # GGUF value type -> struct format
    gguf.GGUFValueType.UINT8: "<B",
    gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H",
    gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I",
    gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.FLOAT32: "<f",
    gguf.GGUFValueType.BOOL: "<?",
    gguf.GGUFValueType.UINT64: "<Q",
    gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT64: "<d",
}
_Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = (  # the weight types gguf.quants.dequantize implements
    _Q.F32, _Q.F16, _Q.BF16,
    _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0,
    _Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K,
    _Q.IQ1_S, _Q.IQ1_M, _Q.IQ2_XXS, _Q.IQ2_XS, _Q.IQ2_S, _Q.IQ3_XXS, _Q.IQ3_S, _Q.IQ4_NL, _Q.IQ4_XS,
    _Q.TQ1_0, _Q.TQ2_0, _Q.MXFP4,
)  # fmt: skip
_MAX_DIMS = 4
_FLOATS = {_Q.F32: np.dtype("<f4"), _Q.F16: np.dtype("<f2"), _Q.BF16: np.dtype(ml_dtypes.bfloat16)}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where a tensor's data lies: shape in numpy order (outermost first), GGML type, absolute byte span."""

    name: str
    shape: tuple[int, ...]
    ggml_type: gguf.GGMLQuantizationType
    start: int
    nbytes: int


class _Cursor:
    """Reads the header front to back; every read is checked against the end of the file."""

    def __init__(self, buf: mmap.mmap | bytes, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.buf):
            raise TruncatedFileError(
                f"{self.path}: the file ends at byte {len(self.buf)}, but {what} needs bytes {self.pos}..{self.pos + n}"
                " (a truncated or corrupt GGUF file; download or convert it again)"
            )
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        n = self.scalar("<Q", f"the length of {what}")
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorruptFileError(f"{self.path}: {what} at byte {self.pos - n} is not valid UTF-8") from e

    def strings(self, count: int, what: str) -> list[str]:
        """count strings in a row, as `string` reads each (its checks and messages), in one loop: a vocabulary's
        tokens and merges are 408,000 strings in Llama 3's, 1.7 s one `string` call at a time."""
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        length = struct.Struct("<Q").unpack_from
        for i in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.take(8, f"the length of item {i} of {what}")  # raises
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > end:
                self.pos = pos
                self.take(n, f"item {i} of {what}")  # raises
            try:
                out.append(str(buf[pos : pos + n], "utf-8"))
            except UnicodeDecodeError as e:
                raise CorruptFileError(f"{self.path}: item {i} of {what} at byte {pos} is not valid UTF-8") from e
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, what: str) -> Any:
        if vtype == gguf.GGUFValueType.STRING:
            return self.string(what)
        if vtype == gguf.GGUFValueType.ARRAY:
            item_type = self.scalar("<I", f"the item type of {what}")
            count = self.scalar("<Q", f"the length of {what}")
            if count > len(self.buf) - self.pos:  # every item takes at least one byte
                raise TruncatedFileError(
                    f"{self.path}: {what} claims {count} items but only {len(self.buf) - self.pos} bytes remain"
                )
            if item_type in _SCALARS:
                fmt = _SCALARS[gguf.GGUFValueType(item_type)]
                raw = self.take(count * struct.calcsize(fmt), what)
                return np.frombuffer(raw, dtype=np.dtype(fmt)).tolist()
            if item_type == gguf.GGUFValueType.STRING:
                return self.strings(count, what)
            return [self.value(item_type, f"item {i} of {what}") for i in range(count)]
        if vtype not in _SCALARS:
            raise CorruptFileError(f"{self.path}: {what} has an unknown value type {vtype} (byte {self.pos - 4})")
        return self.scalar(_SCALARS[gguf.GGUFValueType(vtype)], what)


class GGUFFile:
    """An open GGUF file: its metadata, its tensor infos (spans checked), and `read(name)` → f32 numpy array."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = self.path.stat().st_size
                self._buf: mmap.mmap | bytes = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{self.path}: no such GGUF file") from e
        except IsADirectoryError as e:
            raise CheckpointNotFoundError(f"{self.path}: is a directory, not a GGUF file") from e
        self.metadata, self.tensors = self._parse()

    def _parse(self) -> tuple[dict[str, Any], dict[str, TensorInfo]]:
        c = _Cursor(self._buf, self.path)
        magic = c.take(4, "the magic number")
        if magic != b"GGUF":
            raise CorruptFileError(f"{self.path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        version = c.scalar("<I", "the version")
        if version not in (2, 3):
            raise CorruptFileError(f"{self.path}: GGUF version {version} is not supported (2 and 3 are)")
        n_tensors = c.scalar("<Q", "the tensor count")
        n_meta = c.scalar("<Q", "the metadata count")
        if n_tensors > len(self._buf) or n_meta > len(self._buf):
            raise CorruptFileError(
                f"{self.path}: the header claims {n_tensors} tensors and {n_meta} metadata entries, more than a"
                f" file of {len(self._buf)} bytes can hold"
            )
        meta: dict[str, Any] = {}
        for i in range(n_meta):
            key = c.string(f"the key of metadata entry {i}")
            vtype = c.scalar("<I", f"the type of metadata {key!r}")
            if key in meta:
                raise CorruptFileError(f"{self.path}: metadata key {key!r} appears twice")
            meta[key] = c.value(vtype, f"metadata {key!r}")
        infos = []
        for i in range(n_tensors):
            name = c.string(f"the name of tensor {i}")
            n_dims = c.scalar("<I", f"the dimension count of tensor {name!r}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise CorruptFileError(f"{self.path}: tensor {name!r} claims {n_dims} dimensions (1..{_MAX_DIMS})")
            dims = [c.scalar("<Q", f"the dimensions of tensor {name!r}") for _ in range(n_dims)]
            type_id = c.scalar("<I", f"the type of tensor {name!r}")
            offset = c.scalar("<Q", f"the data offset of tensor {name!r}")
            infos.append((name, dims, type_id, offset))
        alignment = meta.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise CorruptFileError(f"{self.path}: general.alignment {alignment!r} is not a power of two")
        data_start = -(-c.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        expected, previous = 0, None  # llama.cpp's rule: each tensor's data follows the one before, padded
        for name, dims, type_id, offset in infos:
            if name in tensors:
                raise CorruptFileError(f"{self.path}: tensor {name!r} appears twice")
            info = self._tensor_info(name, dims, type_id, offset, data_start, alignment)
            if offset != expected:
                after = (
                    f"the tensor before it, {previous.name!r} ({previous.ggml_type.name}, {previous.nbytes} bytes),"
                    f" ends at offset {expected} (padded to {alignment})"
                    if previous is not None
                    else "the first tensor's data starts the data section (offset 0)"
                )
                raise TensorSpanError(
                    f"{self.path}: tensor {name!r} starts at data offset {offset}, but {after}; the tensors' data"
                    " must follow one another in header order, as llama.cpp requires, so the file is corrupt"
                )
            tensors[name], previous = info, info
            expected += -(-info.nbytes // alignment) * alignment
        if previous is not None and len(self._buf) > data_start + expected:
            raise TensorSpanError(
                f"{self.path}: the file holds {len(self._buf) - data_start - expected} bytes after the data of its last"
                f" tensor, {previous.name!r} ({previous.ggml_type.name}, {previous.nbytes} bytes, padded to"
                f" {alignment}), where every GGUF writer ends it: a tensor's type or dimensions were changed, or the"
                " file is corrupt"
            )
        return meta, tensors

    def _tensor_info(
        self, name: str, dims: list[int], type_id: int, offset: int, data_start: int, alignment: int
    ) -> TensorInfo:
        try:
            ggml_type = gguf.GGMLQuantizationType(type_id)
        except ValueError as e:
            raise CorruptFileError(f"{self.path}: tensor {name!r} has an unknown GGML type {type_id}") from e
        block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
        if any(d < 1 for d in dims) or dims[0] % block:
            raise CorruptFileError(
                f"{self.path}: tensor {name!r} has dimensions {dims}, which a {ggml_type.name} tensor cannot have"
                f" (each positive, the first a multiple of {block})"
            )
        if ggml_type not in SUPPORTED_TYPES:
            raise UnsupportedDTypeError(
                f"{self.path}: tensor {name!r} is stored as {ggml_type.name}; llama-jax reads"
                f" {', '.join(t.name for t in SUPPORTED_TYPES)} (requantize the file with llama.cpp's llama-quantize)"
            )
        nbytes = int(np.prod(dims, dtype=object)) // block * type_size
        start = data_start + offset
        if offset % alignment:
            raise CorruptFileError(
                f"{self.path}: tensor {name!r} starts at offset {offset}, not a multiple of {alignment}"
            )
        if start + nbytes > len(self._buf):
            raise TensorSpanError(
                f"{self.path}: tensor {name!r} ({ggml_type.name}, {nbytes} bytes) occupies bytes"
                f" {start}..{start + nbytes}, past the end of the file ({len(self._buf)} bytes);"
                " the file is truncated or its header corrupt"
            )
        return TensorInfo(name, tuple(reversed(dims)), ggml_type, start, nbytes)

    def _raw(self, info: TensorInfo) -> np.ndarray:
        """A tensor's bytes, a read-only view of a mapping of its span alone: the page cache's own pages, faulted in
        many at a time, with no copy (the loader copies each layer into its stack: reading into a fresh array first
        faulted and copied every byte twice, 9.5 s of an 8B file's 12.5 s load). The pages leave the process's
        memory with the view, where the whole file's mapping would keep every tensor's resident beside its copy
        until the file is closed."""
        if info.nbytes == 0:
            return np.empty(0, np.uint8)
        first = info.start - info.start % mmap.ALLOCATIONGRANULARITY
        try:
            with open(self.path, "rb") as f:
                span = mmap.mmap(f.fileno(), info.start + info.nbytes - first, access=mmap.ACCESS_READ, offset=first)
        except (OSError, ValueError) as e:
            raise TruncatedFileError(
                f"{self.path}: tensor {info.name!r} could not be read whole ({e}); the file changed"
            ) from e
        return np.frombuffer(span, np.uint8, count=info.nbytes, offset=info.start - first)

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to f32, shaped outermost first (a [out, in] matrix for a weight)."""
        info = self.tensors[name]
        with np.errstate(invalid="ignore"):  # inf·0 of a corrupt scale: NaN, which Weights refuses by name
            return dequantize(self._raw(info), info.ggml_type).reshape(info.shape)

    def read_stored(self, name: str) -> np.ndarray | Blocks:
        """Tensor `name` as the file stores it, where llama-jax computes on that type: F32, F16 and BF16 as numpy
        arrays of their dtype, the `quantized.FORMATS` as blocks [rows, cols / values, bytes]; any other type
        dequantized to f32 (`read`)."""
        info = self.tensors[name]
        if info.ggml_type in _FLOATS:
            return self._raw(info).view(_FLOATS[info.ggml_type]).reshape(info.shape)
        if info.ggml_type in FORMATS:
            fmt = FORMATS[info.ggml_type]
            return fmt(self._raw(info).reshape(*info.shape[:-1], info.shape[-1] // fmt.VALUES, fmt.BYTES))
        return self.read(name)


def dequantize(raw: np.ndarray, ggml_type: gguf.GGMLQuantizationType) -> np.ndarray:
    """Bytes of one of the SUPPORTED_TYPES as a flat f32 array, by gguf-py's reference dequantizer, which follows
    ggml's order of operations (`d·q + m` in f32 for Q4_1, say): the tensors transformers reads from the file."""
    return gguf.quants.dequantize(raw, ggml_type).reshape(-1).astype(np.float32, copy=False)
