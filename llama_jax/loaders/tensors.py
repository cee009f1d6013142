"""A checkpoint's tensors, by Hugging Face name, into the weights pytrees: the one place that checks their names
and shapes against the config (a wrong one names the tensor, the expected and the found shape), refuses
non-finite values, converts them to the dtype asked for and stacks the layers. The loaders (`checkpoint`) hand
the tensors over as lazy reads, so a bad file fails early.
"""

from __future__ import annotations

import mmap
import re
from collections.abc import Callable, Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from llama_jax.core import arrays
from llama_jax.core.config import LlamaConfig
from llama_jax.core.quantized import Blocks, Mixed, kind
from llama_jax.core.weights import DTYPES, WEIGHT_DTYPES, LayerWeights, Weights
from llama_jax.errors import (
    ConfigMismatchError,
    MissingTensorError,
    NonFiniteTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedDTypeError,
)


def weights_from_tensors(
    config: LlamaConfig,
    get: Mapping[str, Callable[[], np.ndarray]],
    source: str,
    dtype: str = "float32",
    file_names: Mapping[str, str] | None = None,
    progress: bool = False,
) -> Weights:
    """The weights of a checkpoint's tensors by Hugging Face name; `get[name]()` reads one (lazily, so a bad file
    fails early): a numpy array of a float dtype, or ggml blocks (`quantized`).

    Refuses missing and unexpected tensors (all listed) and any shape the config does not derive.
    dtype: "stored" (each tensor as the checkpoint holds it: f32, f16, bf16 or ggml blocks; a matrix whose
    layers are stored in different types is held in f32), "float32" (everything widened or dequantized
    exactly) or "bfloat16" (half of f32's memory). Compute is f32 in every case.
    file_names: the names the file itself uses (GGUF), shown beside the Hugging Face names in errors.
    progress: show a progress bar (on stderr) while the tensors are read.
    """
    target = _target_dtype(dtype)
    shapes = hf_shapes(config)
    file_names = file_names or {}

    def shown(names: list[str]) -> str:
        return _listing([f"{n} ({file_names[n]})" if n in file_names else n for n in names])

    names = set(get)
    ignored = {n for n in names if _IGNORED.fullmatch(n)}
    head, emb_name = arrays.MODEL.lm_head.hf, arrays.MODEL.emb.hf
    tied_copy = config.tied and head in names  # some tied checkpoints store a copy; checked below
    if tied_copy:
        ignored.add(head)
        shapes = shapes | {head: arrays.MODEL.lm_head.shape(config)}
    missing = sorted(set(shapes) - names, key=_natural)
    unexpected = sorted(names - set(shapes) - ignored, key=_natural)
    if missing:
        raise MissingTensorError(
            f"{source}: {len(missing)} tensor(s) the config requires are missing: {shown(missing)}"
            " (do the config and the weights belong together?)"
        )
    if unexpected:
        raise UnexpectedTensorError(
            f"{source}: {len(unexpected)} tensor(s) have no place in a Llama model with this config:"
            f" {shown(unexpected)}"
        )

    from tqdm import tqdm  # here: a progress stack costs start-up time

    bar = tqdm(total=len(shapes), desc=f"loading {Path(source).name}", unit="tensor", disable=not progress, leave=False)

    def read(name: str, to: np.dtype | None = target) -> np.ndarray | Blocks:
        """Tensor `name`, shape and values checked, converted to `to` (None: as stored)."""
        stored = get[name]()
        if tuple(stored.shape) != shapes[name]:
            raise TensorShapeError(
                f"{source}: tensor {shown([name])} has shape {tuple(stored.shape)}, but the config gives"
                f" {shapes[name]} (dim {config.dim}, qw {config.qw}, kvw {config.kvw}, ffn {config.ffn}, vocab"
                f" {config.vocab})"
            )
        bar.update()
        if isinstance(stored, Blocks) and to is None and stored.host_scales_finite():
            return stored  # finite scales and integer quants: finite values
        values = stored.host_dequantize() if isinstance(stored, Blocks) else stored
        converted = values if to is None else values.astype(to, copy=False)
        _check_finite(values, converted, f"{source}: tensor {shown([name])}")  # raises for a bad block's scale
        return converted

    def stack(field: str, to: np.dtype | None = target) -> jax.Array | Blocks | Mixed:
        """One field of every layer, each tensor read once and copied into its row of an array the device then
        shares; layers held in different kinds (as stored), one such array per kind (`Mixed`). A kind's array is
        allocated with a row for every layer and used for its first rows only: the rows never written are never
        touched, so they take no memory, and no kind is held twice while the layers are sorted."""
        buffers: dict[object, tuple[np.ndarray | Blocks, np.ndarray]] = {}  # kind: (its first tensor, its rows)
        places = []  # each layer's (kind's index, row)
        for i in range(config.layers):
            tensor = read(arrays.LAYER[field].hf.format(i), to)
            if kind(tensor) not in buffers:
                buffers[kind(tensor)] = (
                    tensor,
                    host_buffer((config.layers, *_data(tensor).shape), _data(tensor).dtype),
                )
            index = list(buffers).index(kind(tensor))
            row = sum(place[0] == index for place in places)
            buffers[kind(tensor)][1][row] = _data(tensor)
            places.append((index, row))
        parts = []
        for index, (first, rows) in enumerate(buffers.values()):
            parts.append(_on_device(first, rows[: sum(place[0] == index for place in places)]))
        return parts[0] if len(parts) == 1 else Mixed(tuple(parts), tuple(places))

    def held(name: str) -> jax.Array | Blocks:
        """Tensor `name` on the device; what it was read from (a view of the file's pages) let go on return."""
        tensor = read(name)
        if name == emb_name and tied_copy and not np.array_equal(_data(read(head)), _data(tensor)):
            raise ConfigMismatchError(
                f"{source}: the config says the LM head is tied to the embedding, but {head} differs"
                f" from {emb_name}; set tie_word_embeddings to false"
            )
        return _on_device(tensor, _data(tensor))

    # the two largest tensors first, each let go of once copied, so their pages are never resident beside the layers
    emb, lm_head = held(emb_name), None if config.tied else held(head)
    weights = Weights(
        emb=emb,
        layers=LayerWeights(**{field: stack(field) for field, spec in arrays.LAYER.items() if spec.present(config)}),
        lnf=jnp.asarray(read(arrays.MODEL.lnf.hf)),
        lm_head=lm_head,
    )
    bar.close()
    return weights


_ALIGN = 64  # the alignment XLA's CPU client needs to use a host buffer in place


def host_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array the device can share in place, in pages of its own (an anonymous mapping, page-
    aligned): its memory goes back to the system when it is dropped, where malloc would keep a read's freed buffer
    resident in its heap, and pages never written take none (a `stack`'s unused rows)."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    pages = mmap.mmap(-1, max(size, 1))
    return np.frombuffer(pages, dtype=np.uint8, count=size).view(dtype).reshape(shape)


def _data(tensor: np.ndarray | Blocks) -> np.ndarray:
    """The array that holds a tensor's data: its values, or its blocks."""
    return tensor.blocks if isinstance(tensor, Blocks) else tensor


def _on_device(like: np.ndarray | Blocks, data: np.ndarray) -> jax.Array | Blocks:
    """data (a tensor's values or blocks, possibly stacked) on the device, held as `like` is."""
    return type(like)(_shared(data)) if isinstance(like, Blocks) else _shared(data)


def _shared(array: np.ndarray) -> jax.Array:
    """A host array as a JAX array that uses its memory in place (the CPU device aliases an aligned buffer), so
    loading holds each weight once instead of twice. The caller must not write to `array` afterwards. A read-only
    array (a view of a file's mapping) is copied: its pages are the file's, to be let go once read."""
    if array.ctypes.data % _ALIGN or not array.flags.c_contiguous or not array.flags.writeable:
        aligned = host_buffer(array.shape, array.dtype)
        aligned[...] = array
        array = aligned
    return jax.device_put(array, may_alias=True)


# buffers older transformers versions saved, recomputed from the config
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def hf_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of a checkpoint, by Hugging Face name, derived from the config (`arrays`)."""
    return {name: spec.checkpoint_shape(config) for name, (_, spec, _) in arrays.checkpoint_arrays(config).items()}


def _target_dtype(dtype: str) -> np.dtype | None:
    """The dtype to convert to; None to hold the stored types."""
    if dtype not in WEIGHT_DTYPES:
        raise UnsupportedDTypeError(f"dtype {dtype!r} is not offered; choose one of {', '.join(WEIGHT_DTYPES)}")
    return DTYPES.get(dtype)


def _natural(name: str) -> list[int | str]:
    """Sort key that puts layer 2 before layer 10."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _check_finite(array: np.ndarray, converted: np.ndarray, what: str) -> None:
    """Refuses NaN and ±inf in a tensor just read, as read and as converted to the weights' dtype (llama.cpp's
    check_tensors), in one pass while it is still in cache. The pass: x·x of the float32 values (one BLAS reduction,
    no temporary; about 0.2 ms per million values, 2× faster than isfinite(x).all()) is finite only if every |x| is
    below 1.8e19, so finite in bfloat16 too. When it is not (a NaN, an inf, or a huge value) the exact test decides:
    isfinite, or for bfloat16 its exponent bits (all ones: not finite)."""
    source = array if array.dtype == np.float32 else converted if converted.dtype == np.float32 else None
    if source is not None:
        flat = source.reshape(-1)
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow here only sends it to the exact test
            if np.isfinite(np.dot(flat, flat)):
                return
    if converted.dtype == DTYPES["bfloat16"]:
        finite = not ((converted.view(np.uint16) & 0x7F80) == 0x7F80).any()
    else:
        finite = bool(np.isfinite(converted).all())
    if finite:
        return
    values = converted.astype(np.float32)
    bad = ~np.isfinite(values)
    first = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), values.shape))
    raise NonFiniteTensorError(
        f"{what} holds {int(np.isnan(values).sum())} NaN and {int(np.isinf(values).sum())} infinite values (the first"
        f" at index {first}: {values[first]}), stored as such or from a quantized block's scale; a checkpoint's"
        " weights are finite, so the file is corrupt: download or convert it again"
    )


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, and {len(names) - limit} more"
