"""The weights as Flax-free pytrees: frozen dataclasses registered with JAX, every array typed with its shape.

The per-layer weights are stacked along a leading layers axis, so `lax.scan` runs the layers (compile time
independent of depth). Matrices keep PyTorch's layout, [out, in] (the spec's LW: row = output). Each array's
axes (its jaxtyping annotation, in the letters of `core.config`), checkpoint names and sharding come from `arrays`.
A matrix is held as f32, f16 or bf16 values, or as ggml blocks (`quantized`); `loaders.tensors` builds the
weights from a checkpoint's tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import jax
import ml_dtypes
import numpy as np
from jaxtyping import Array, Float

from llama_jax.core import arrays
from llama_jax.core.config import LlamaConfig
from llama_jax.core.quantized import Blocks, Mixed, dense, kind

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}  # converted on load
STORED = "stored"  # each tensor held as the checkpoint stores it (see `from_hf_tensors`)
WEIGHT_DTYPES = (STORED, *DTYPES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerWeights:
    """Every layer's weights (the spec's LW), stacked: entry i of each array belongs to layer i (of a `Mixed`
    matrix, held where its places say). Each field's axes (its annotation), checkpoint names and sharding are in
    `arrays.LAYER`; the biases and per-head norms are None where the config's switches give none."""

    ln1: Float[Array, arrays.LAYER.ln1.annotation]
    q: Float[Array, arrays.LAYER.q.annotation] | Blocks | Mixed
    k: Float[Array, arrays.LAYER.k.annotation] | Blocks | Mixed
    v: Float[Array, arrays.LAYER.v.annotation] | Blocks | Mixed
    o: Float[Array, arrays.LAYER.o.annotation] | Blocks | Mixed
    ln2: Float[Array, arrays.LAYER.ln2.annotation]
    gate: Float[Array, arrays.LAYER.gate.annotation] | Blocks | Mixed
    up: Float[Array, arrays.LAYER.up.annotation] | Blocks | Mixed
    down: Float[Array, arrays.LAYER.down.annotation] | Blocks | Mixed
    q_bias: Float[Array, arrays.LAYER.q_bias.annotation] | None = None
    k_bias: Float[Array, arrays.LAYER.k_bias.annotation] | None = None
    v_bias: Float[Array, arrays.LAYER.v_bias.annotation] | None = None
    o_bias: Float[Array, arrays.LAYER.o_bias.annotation] | None = None
    gate_bias: Float[Array, arrays.LAYER.gate_bias.annotation] | None = None
    up_bias: Float[Array, arrays.LAYER.up_bias.annotation] | None = None
    down_bias: Float[Array, arrays.LAYER.down_bias.annotation] | None = None
    q_norm: Float[Array, arrays.LAYER.q_norm.annotation] | None = None
    k_norm: Float[Array, arrays.LAYER.k_norm.annotation] | None = None

    def bias(self, matrix: str) -> Float[Array, "*L O"] | None:
        """The bias of a matrix's products (`matrix`_bias), None where it has none."""
        return getattr(self, f"{matrix}_bias")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Weights:
    """A model's weights (the spec's Model): embedding, stacked layers, final norm, and an untied LM head if any."""

    emb: Float[Array, arrays.MODEL.emb.annotation] | Blocks
    layers: LayerWeights
    lnf: Float[Array, arrays.MODEL.lnf.annotation]
    lm_head: Float[Array, arrays.MODEL.lm_head.annotation] | Blocks | None = None

    def unembedding(self) -> Float[Array, "V D"] | Blocks:
        """The LM head: the embedding when tied (the spec's logits = emb · nf)."""
        return self.emb if self.lm_head is None else self.lm_head

    def dequantized(self) -> Weights:
        """These weights with every block matrix as its f32 values (for gradients with respect to them)."""
        return jax.tree.map(dense, self, is_leaf=lambda x: isinstance(x, (Blocks, Mixed)))

    def bfloat16_matrices(self) -> Weights:
        """These weights as the bfloat16 tier holds them: every matrix held in f32 or f16 (the embedding, an LM head,
        the layers', a `Mixed` stack's float parts) rounded to bf16 once (ties to even); bf16 matrices and ggml
        blocks, whose values bf16 activations multiply exactly in f32, as they are; norms and biases (added in f32,
        never multiplied) too."""

        def rounded(w):
            if isinstance(w, Mixed):
                return dataclasses.replace(w, parts=tuple(rounded(p) for p in w.parts))
            if w is None or isinstance(w, Blocks) or w.dtype not in (np.float32, np.float16):
                return w
            return w.astype(DTYPES["bfloat16"])

        layers = {f: rounded(getattr(self.layers, f)) for f in arrays.LAYER_MATRICES}
        return dataclasses.replace(
            self,
            emb=rounded(self.emb),
            lm_head=rounded(self.lm_head),
            layers=dataclasses.replace(self.layers, **layers),
        )

    def held(self) -> dict[str, tuple[int, int]]:
        """How the arrays are held: {kind (Q4_1, float32, ...): (arrays, bytes)}, largest first, a stacked field
        counting one array per layer."""
        out: dict[str, tuple[int, int]] = {}
        fields = [(self.emb, 1), (self.lnf, 1), (self.lm_head, 1)]
        for f in arrays.LAYER:
            w = getattr(self.layers, f)
            if w is not None:
                fields += [(part, part.shape[0]) for part in w.parts] if isinstance(w, Mixed) else [(w, w.shape[0])]
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
        in blocks of its format), an LM head exactly when the config is untied, and the switches' arrays (biases,
        per-head norms) exactly where the config has them. At trace time inside jit: free per call."""
        import chex  # here, not at import: it pulls in absl, unittest and pdb (~6 MB), and only tracing needs it

        chex.assert_equal(self.lm_head is None, config.tied)
        held = [(getattr(self, f), spec) for f, spec in arrays.MODEL.items() if getattr(self, f) is not None]
        for f, spec in arrays.LAYER.items():
            chex.assert_equal(getattr(self.layers, f) is not None, spec.present(config))
        held += [(getattr(self.layers, f), spec) for f, spec in arrays.LAYER.items() if spec.present(config)]
        for w, spec in held:
            shape = spec.shape(config)
            parts = [(w, shape)]
            if isinstance(w, Mixed):  # each part holds some of the layers
                chex.assert_equal(len(w.places), shape[0])
                parts = [(part, (part.shape[0], *shape[1:])) for part in w.parts]
            for part, part_shape in parts:
                if isinstance(part, Blocks):
                    chex.assert_shape(part.blocks, (*part_shape[:-1], part_shape[-1] // part.VALUES, part.BYTES))
                else:
                    chex.assert_shape(part, part_shape)

    def hf_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """The weights by Hugging Face name, one layer at a time (the inverse of `from_hf_tensors`), blocks
        dequantized."""
        yield arrays.MODEL.emb.hf, np.asarray(dense(self.emb))
        for field, spec in arrays.LAYER.items():
            stacked = getattr(self.layers, field)
            for i in range(0 if stacked is None else stacked.shape[0]):
                layer = stacked.layer(i) if isinstance(stacked, Mixed) else jax.tree.map(lambda a, i=i: a[i], stacked)
                yield spec.hf.format(i), np.asarray(dense(layer))
        yield arrays.MODEL.lnf.hf, np.asarray(self.lnf)
        if self.lm_head is not None:
            yield arrays.MODEL.lm_head.hf, np.asarray(dense(self.lm_head))
