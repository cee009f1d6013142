"""A reader of the safetensors format that checks every span: one file, or a sharded set with its index.

Layout: u64 little-endian header length N, N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}},
then the data; offsets are relative to the end of the header. As the safetensors library requires, the tensors tile
the data exactly: no gap, no overlap, nothing after the last one. Only the header is read up front; a tensor is read
(pread into a new array) when asked for, so loading holds the weights once, not the file's mapped pages as well.
Supported dtypes: F32, F16, BF16.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from llama_jax.errors import (
    CheckpointNotFoundError,
    CorruptFileError,
    TensorSpanError,
    TruncatedFileError,
    UnsupportedDTypeError,
)

DTYPES = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype(ml_dtypes.bfloat16)}
_Entry = tuple[np.dtype, tuple[int, ...], int, int]  # dtype, shape, first byte, end byte (in the file)
_OTHER_DTYPES = {"F64", "I64", "I32", "I16", "I8", "U8", "BOOL", "F8_E4M3", "F8_E5M2", "U16", "U32", "U64"}


class SafetensorsFile:
    """One .safetensors file: `names`, `read(name)` → numpy array in its stored dtype, `memmap(name)` → the same
    as a read-only memory map. dtypes: the dtypes it may hold, by safetensors name (checkpoints: DTYPES)."""

    def __init__(self, path: str | Path, dtypes: dict[str, np.dtype] = DTYPES):
        self.path = Path(path)
        self._dtypes = dtypes
        try:
            with open(self.path, "rb") as f:
                self._size = self.path.stat().st_size
                head = f.read(8)
                length = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                self._header = head + f.read(min(length, self._size))
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"{self.path}: no such safetensors file") from e
        except IsADirectoryError as e:
            raise CheckpointNotFoundError(f"{self.path}: is a directory, not a safetensors file") from e
        self._entries = self._parse()

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def _parse(self) -> dict[str, _Entry]:
        size = self._size
        if size < 8:
            raise TruncatedFileError(f"{self.path}: {size} bytes, too short for a safetensors header (8-byte length)")
        (n,) = struct.unpack("<Q", self._header[:8])
        if n > size - 8:
            raise TruncatedFileError(
                f"{self.path}: the header claims {n} bytes but the file has only {size - 8} after the length"
                " (truncated, or not a safetensors file)"
            )
        try:
            header = json.loads(self._header[8 : 8 + n].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptFileError(f"{self.path}: the header is not valid JSON ({e}); the file is corrupt") from e
        if not isinstance(header, dict):
            raise CorruptFileError(f"{self.path}: the header is not a JSON object")
        header.pop("__metadata__", None)
        data_start = 8 + n
        entries = {}
        for name, entry in header.items():
            entries[name] = self._entry(name, entry, data_start, size)
        self._check_coverage(entries, data_start, size)
        return entries

    def _check_coverage(self, entries: dict[str, _Entry], data_start: int, size: int) -> None:
        """The safetensors library's rule (`Metadata::validate` and `read_metadata`): the tensors, sorted by their
        spans, tile the data region exactly, from its first byte to the end of the file, with no gap, no overlap and
        nothing left over. A header length that is off (every tensor shifted) breaks it too."""
        at, previous = data_start, None
        for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: item[1][2:]):
            if begin != at:
                if begin > at:
                    where = f"after tensor {previous!r}" if previous is not None else "at the start of the data"
                    problem = f"bytes {at}..{begin} {where} belong to no tensor"
                else:
                    problem = f"it overlaps tensor {previous!r}, which ends at byte {at}"
                raise TensorSpanError(
                    f"{self.path}: tensor {name!r} occupies bytes {begin}..{end}, but {problem}; the tensors of a"
                    " safetensors file tile its data region exactly, so the file is corrupt"
                )
            at, previous = end, name
        if at != size:
            last = f"the last tensor, {previous!r}," if previous is not None else "the header (it names no tensor)"
            raise TensorSpanError(
                f"{self.path}: {last} ends at byte {at}, but the file holds {size - at} more bytes that belong to no"
                f" tensor (the header length, {data_start - 8}, may be wrong); the file is corrupt"
            )

    def _entry(self, name: str, entry: object, data_start: int, size: int) -> _Entry:
        malformed = f"{self.path}: the header entry of tensor {name!r} is malformed ({entry!r}); the file is corrupt"
        try:
            dtype_name, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            shape = tuple(shape)
        except (TypeError, KeyError, ValueError) as e:
            raise CorruptFileError(malformed) from e
        if not all(type(v) is int for v in (*shape, begin, end)):  # JSON integers (the library's usize): not 2.0, "2"
            raise CorruptFileError(malformed)
        if not isinstance(dtype_name, str):
            raise CorruptFileError(
                f"{self.path}: tensor {name!r} has dtype {dtype_name!r}, not a name; the file is corrupt"
            )
        if dtype_name not in self._dtypes:
            known = "a type llama-jax does not read here" if dtype_name in _OTHER_DTYPES else "not a safetensors dtype"
            raise UnsupportedDTypeError(
                f"{self.path}: tensor {name!r} is stored as {dtype_name!r}, {known}; supported:"
                f" {', '.join(self._dtypes)}"
            )
        dtype = self._dtypes[dtype_name]
        if any(d < 0 for d in shape) or not 0 <= begin <= end:
            raise CorruptFileError(f"{self.path}: tensor {name!r} has shape {shape} and offsets {[begin, end]}")
        if end - begin != int(np.prod(shape, dtype=object)) * dtype.itemsize:
            raise CorruptFileError(
                f"{self.path}: tensor {name!r} of shape {shape} ({dtype_name}) needs"
                f" {int(np.prod(shape, dtype=object)) * dtype.itemsize} bytes but its offsets span {end - begin}"
            )
        if data_start + end > size:
            raise TensorSpanError(
                f"{self.path}: tensor {name!r} occupies bytes {data_start + begin}..{data_start + end}, past the end"
                f" of the file ({size} bytes); the file is truncated or its header corrupt"
            )
        return dtype, shape, data_start + begin, data_start + end

    def read(self, name: str) -> np.ndarray:
        dtype, shape, begin, end = self._entries[name]
        array = np.empty(shape, dtype=dtype)
        with open(self.path, "rb") as f:
            f.seek(begin)
            got = f.readinto(array.reshape(-1).view(np.uint8))
        if got != end - begin:
            raise TruncatedFileError(f"{self.path}: tensor {name!r} ends past the file (it changed while loading?)")
        return array

    def memmap(self, name: str) -> np.ndarray:
        dtype, shape, begin, _ = self._entries[name]
        if 0 in shape:  # numpy cannot map zero bytes
            return np.empty(shape, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=begin, shape=shape)


def open_safetensors(directory: Path) -> dict[str, Callable[[], np.ndarray]]:
    """Every tensor of a checkpoint directory by name, read lazily: `model.safetensors`, or the shards named by
    `model.safetensors.index.json` (each tensor must lie in the shard the index names)."""
    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CorruptFileError(f"{index}: not a valid safetensors index ({e})") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CorruptFileError(
                f"{index}: not a valid safetensors index (weight_map is not an object of tensor name -> file name)"
            )
        shards: dict[str, SafetensorsFile] = {}
        for shard in sorted(set(weight_map.values())):
            if not (directory / shard).exists():
                raise CheckpointNotFoundError(f"{index}: names shard {shard!r}, which is not in {directory}")
            shards[shard] = SafetensorsFile(directory / shard)
        getters = {}
        for name, shard in weight_map.items():
            if name not in shards[shard]:
                raise CorruptFileError(f"{index}: names {shard} as the file of tensor {name!r}, which it does not hold")
            getters[name] = lambda f=shards[shard], n=name: f.read(n)
        for shard, f in shards.items():
            extra = sorted(set(f.names) - set(weight_map))
            if extra:
                raise CorruptFileError(f"{directory / shard}: holds tensors the index does not list: {extra[:8]}")
        return getters
    if single.exists():
        f = SafetensorsFile(single)
        return {name: (lambda n=name: f.read(n)) for name in f.names}
    raise CheckpointNotFoundError(
        f"{directory}: no model.safetensors and no model.safetensors.index.json; a Hugging Face checkpoint directory"
        " holds one of them beside config.json"
    )
