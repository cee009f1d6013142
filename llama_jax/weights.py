"""The weights as Flax-free pytrees: frozen dataclasses registered with JAX, every array typed with its shape.

The per-layer weights are stacked along a leading layers axis, so `lax.scan` runs the layers (compile time
independent of depth). Matrices keep PyTorch's layout, [out, in] (the spec's LW: row = output). Each array's
axes (its jaxtyping annotation, named by the config's sizes), checkpoint names and sharding come from `arrays`.

Checkpoint loaders hand tensors over by their Hugging Face names; `Weights.from_hf_tensors` is the one place that
checks names and shapes (a wrong one names the tensor, the expected and the found shape) and stacks the layers.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jaxtyping import Array, Float

from llama_jax import arrays
from llama_jax.config import LlamaConfig
from llama_jax.errors import (
    ConfigMismatchError,
    MissingTensorError,
    NonFiniteTensorError,
    TensorShapeError,
    UnexpectedTensorError,
    UnsupportedDTypeError,
)
from llama_jax.quantized import BLOCK, Blocks, dense, kind

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}  # converted on load
STORED = "stored"  # each tensor held as the checkpoint stores it (see `from_hf_tensors`)
WEIGHT_DTYPES = (STORED, *DTYPES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """Every layer's weights (the spec's LW), stacked: entry i of each array belongs to layer i. Each field's axes
    (its annotation), checkpoint names and sharding are in `arrays.LAYER`."""

    ln1: Float[Array, arrays.LAYER.ln1.annotation]
    q: Float[Array, arrays.LAYER.q.annotation] | Blocks
    k: Float[Array, arrays.LAYER.k.annotation] | Blocks
    v: Float[Array, arrays.LAYER.v.annotation] | Blocks
    o: Float[Array, arrays.LAYER.o.annotation] | Blocks
    ln2: Float[Array, arrays.LAYER.ln2.annotation]
    gate: Float[Array, arrays.LAYER.gate.annotation] | Blocks
    up: Float[Array, arrays.LAYER.up.annotation] | Blocks
    down: Float[Array, arrays.LAYER.down.annotation] | Blocks


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
    """A model's weights (the spec's Model): embedding, stacked layers, final norm, and an untied LM head if any."""

    emb: Float[Array, arrays.MODEL.emb.annotation] | Blocks
    layers: LayerWeights
    lnf: Float[Array, arrays.MODEL.lnf.annotation]
    lm_head: Float[Array, arrays.MODEL.lm_head.annotation] | Blocks | None = None

    def head(self) -> Float[Array, "vocab dim"] | Blocks:
        """The LM head: the embedding when tied (the spec's logits = emb · nf)."""
        return self.emb if self.lm_head is None else self.lm_head

    def dequantized(self) -> Weights:
        """These weights with every block matrix as its f32 values (for gradients with respect to them)."""
        return jax.tree.map(dense, self, is_leaf=lambda x: isinstance(x, Blocks))

    def held(self) -> dict[str, tuple[int, int]]:
        """How the arrays are held: {kind (Q4_1, float32, ...): (arrays, bytes)}, largest first, a stacked field
        counting one array per layer."""
        out: dict[str, tuple[int, int]] = {}
        fields = [(self.emb, 1), (self.lnf, 1), (self.lm_head, 1)]
        fields += [(getattr(self.layers, f), self.layers.ln1.shape[0]) for f in arrays.LAYER]
        for w, count in fields:
            if w is not None:
                n, size = out.get(kind(w), (0, 0))
                out[kind(w)] = (n + count, size + w.nbytes)
        return dict(sorted(out.items(), key=lambda item: -item[1][1]))

    def describe(self) -> str:
        """What is held, largest first: "Q4_1 (210 arrays, 66.4 MB), ..."."""
        held = self.held().items()
        return ", ".join(f"{k} ({n} array{'s' * (n != 1)}, {size / 1e6:.1f} MB)" for k, (n, size) in held)

    def assert_matches(self, config: LlamaConfig) -> None:
        """chex asserts that every array has the shape the config derives (`arrays`; blocks: their matrix's shape
        in blocks of its format), and an LM head exactly when the config is untied. At trace time inside jit: free
        per call."""
        chex.assert_equal(self.lm_head is None, config.tied)
        held = [(getattr(self, f), spec) for f, spec in arrays.MODEL.items() if getattr(self, f) is not None]
        held += [(getattr(self.layers, f), spec) for f, spec in arrays.LAYER.items()]
        for w, spec in held:
            shape = spec.shape(config)
            if isinstance(w, Blocks):
                chex.assert_shape(w.blocks, (*shape[:-1], shape[-1] // BLOCK, w.BYTES))
            else:
                chex.assert_shape(w, shape)

    @classmethod
    def from_hf_tensors(
        cls,
        config: LlamaConfig,
        get: Mapping[str, Callable[[], np.ndarray]],
        source: str,
        dtype: str = "float32",
        file_names: Mapping[str, str] | None = None,
        progress: bool = False,
    ) -> Weights:
        """Weights from tensors by Hugging Face name; `get[name]()` reads one (lazily, so a bad file fails early):
        a numpy array of a float dtype, or ggml blocks (`quantized`).

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
        tied_copy = config.tied and "lm_head.weight" in names  # some tied checkpoints store a copy; checked below
        if tied_copy:
            ignored.add("lm_head.weight")
            shapes = shapes | {"lm_head.weight": (config.vocab, config.dim)}
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

        bar = tqdm(
            total=len(shapes), desc=f"loading {Path(source).name}", unit="tensor", disable=not progress, leave=False
        )

        def read(name: str, to: np.dtype | None = target) -> np.ndarray | Blocks:
            """Tensor `name`, shape and values checked, converted to `to` (None: as stored)."""
            stored = get[name]()
            if tuple(stored.shape) != shapes[name]:
                raise TensorShapeError(
                    f"{source}: tensor {shown([name])} has shape {tuple(stored.shape)}, but the config gives"
                    f" {shapes[name]} (dim {config.dim}, kvw {config.kvw}, ffn {config.ffn}, vocab {config.vocab})"
                )
            bar.update()
            if isinstance(stored, Blocks) and to is None and stored.host_scales_finite():
                return stored  # finite scales and integer quants: finite values
            values = stored.host_dequantize() if isinstance(stored, Blocks) else stored
            converted = values if to is None else values.astype(to, copy=False)
            _check_finite(values, converted, f"{source}: tensor {shown([name])}")  # raises for a bad block's scale
            return converted

        def stack(field: str, to: np.dtype | None = target) -> jax.Array | Blocks:
            """One field of every layer, each tensor copied into its row of an array the device then shares."""
            names = [arrays.LAYER[field].hf.format(i) for i in range(config.layers)]
            first = read(names[0], to)
            stacked = _host_buffer((config.layers, *_data(first).shape), _data(first).dtype)
            for i, name in enumerate(names):
                tensor = first if i == 0 else read(name, to)
                if kind(tensor) != kind(first):  # layers stored in different types: all of them in f32
                    return stack(field, DTYPES["float32"])
                stacked[i] = _data(tensor)
            return _on_device(first, stacked)

        emb = read("model.embed_tokens.weight")
        if tied_copy and not np.array_equal(_data(read("lm_head.weight")), _data(emb)):
            raise ConfigMismatchError(
                f"{source}: the config says the LM head is tied to the embedding, but lm_head.weight differs"
                " from model.embed_tokens.weight; set tie_word_embeddings to false"
            )
        layers = LayerWeights(**{field: stack(field) for field in arrays.LAYER})
        weights = cls(
            emb=_on_device(emb, _data(emb)),
            layers=layers,
            lnf=jnp.asarray(read("model.norm.weight")),
            lm_head=None if config.tied else _on_device(head := read("lm_head.weight"), _data(head)),
        )
        bar.close()
        return weights

    def hf_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """The weights by Hugging Face name, one layer at a time (the inverse of `from_hf_tensors`), blocks
        dequantized."""
        yield "model.embed_tokens.weight", np.asarray(dense(self.emb))
        for field, spec in arrays.LAYER.items():
            stacked = getattr(self.layers, field)
            for i in range(stacked.shape[0]):
                yield spec.hf.format(i), np.asarray(dense(jax.tree.map(lambda a, i=i: a[i], stacked)))
        yield "model.norm.weight", np.asarray(self.lnf)
        if self.lm_head is not None:
            yield "lm_head.weight", np.asarray(dense(self.lm_head))


_ALIGN = 64  # the alignment XLA's CPU client needs to use a host buffer in place


def _host_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised array whose data starts on an _ALIGN-byte boundary."""
    size = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(size + _ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % _ALIGN
    return raw[start : start + size].view(dtype).reshape(shape)


def _data(tensor: np.ndarray | Blocks) -> np.ndarray:
    """The array that holds a tensor's data: its values, or its blocks."""
    return tensor.blocks if isinstance(tensor, Blocks) else tensor


def _on_device(like: np.ndarray | Blocks, data: np.ndarray) -> jax.Array | Blocks:
    """data (a tensor's values or blocks, possibly stacked) on the device, held as `like` is."""
    return type(like)(_shared(data)) if isinstance(like, Blocks) else _shared(data)


def _shared(array: np.ndarray) -> jax.Array:
    """A host array as a JAX array that uses its memory in place (the CPU device aliases an aligned buffer), so
    loading holds each weight once instead of twice. The caller must not write to `array` afterwards."""
    if array.ctypes.data % _ALIGN or not array.flags.c_contiguous:
        aligned = _host_buffer(array.shape, array.dtype)
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
