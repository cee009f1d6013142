"""Every array of a model and of its KV cache, described once: its axes (named by the config's sizes), its names
in Hugging Face and GGUF checkpoints, and where a mesh splits it. The weight pytrees' jaxtyping annotations, the
loaders' name and shape checks, the chex asserts at the jitted boundaries, the shardings and the tests' random
weights all derive from this table.

Axes by the package's one alphabet (`core.config`): L layers, D dim, M qw, C kvw, F ffn, V vocab, H head; the
cache's B batch, K kv heads, S capacity (slots). The config's switches add arrays (`ArraySpec.present`): a bias
of a matrix's output rows where `biases` names it, the per-head norms' gains with `head_norms`. Splitting
(Megatron's): attention by heads (q, k, v by their output rows, o by its input columns, the cache by its kv heads)
and the MLP by its inner width (gate, up by rows, down by columns) over a mesh's model axis; the cache's batch over
its data axis; the rest replicated.
"""

from __future__ import annotations

import dataclasses

from llama_jax.core.config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class ArraySpec:
    """One array. hf and gguf: its checkpoint names ("{}" is the layer for a stacked one, whose checkpoint
    tensors lack the leading layers axis). split: (axis, unit) where the model axis splits it, when the mesh's
    model size divides the unit ("heads": query and kv heads; "ffn": the MLP's width)."""

    axes: tuple[str, ...]
    hf: str = ""
    gguf: str = ""
    split: tuple[int, str] | None = None
    bias_of: str = ""  # a bias's matrix: present where the config's biases name it
    head_norm: bool = False  # a per-head norm's gain: present where the config has head_norms

    def present(self, config: LlamaConfig) -> bool:
        """Whether a model of this config has the array (a bias or a per-head norm only where its switch says)."""
        if self.bias_of:
            return self.bias_of in config.biases
        return config.head_norms if self.head_norm else True

    @property
    def annotation(self) -> str:
        """The jaxtyping shape string, e.g. "*L C D": the layers axis of a stacked array is variadic, as the layer
        scan hands each layer its own slice in the same pytree."""
        return " ".join(f"*{a}" if a == "L" else a for a in self.axes)

    @property
    def stacked(self) -> bool:
        return self.axes[0] == "L"

    def shape(self, config: LlamaConfig, batch: int = 0, capacity: int = 0) -> tuple[int, ...]:
        """The shape under the config (batch and capacity: the cache's)."""
        known = {"L": config.layers, "D": config.dim, "M": config.qw, "C": config.kvw, "F": config.ffn}
        known["V"] = config.vocab
        known |= {"K": config.kv, "H": config.head_dim, "B": batch, "S": capacity}
        return tuple(known[a] for a in self.axes)

    def checkpoint_shape(self, config: LlamaConfig) -> tuple[int, ...]:
        """The shape of one checkpoint tensor: a stacked array's per-layer slice."""
        return self.shape(config)[1:] if self.stacked else self.shape(config)


class Table(dict):
    """Specs by field name, also as attributes, so that annotations read `arrays.LAYER.q.annotation`."""

    def __getattr__(self, name: str) -> ArraySpec:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


LAYER = Table({  # LayerWeights' fields (the spec's LW), stacked over the layers
    "ln1": ArraySpec(("L", "D"), "model.layers.{}.input_layernorm.weight", "blk.{}.attn_norm.weight"),
    "q": ArraySpec(("L", "M", "D"), "model.layers.{}.self_attn.q_proj.weight", "blk.{}.attn_q.weight",
                   (1, "heads")),
    "k": ArraySpec(("L", "C", "D"), "model.layers.{}.self_attn.k_proj.weight", "blk.{}.attn_k.weight",
                   (1, "heads")),
    "v": ArraySpec(("L", "C", "D"), "model.layers.{}.self_attn.v_proj.weight", "blk.{}.attn_v.weight",
                   (1, "heads")),
    "o": ArraySpec(("L", "D", "M"), "model.layers.{}.self_attn.o_proj.weight", "blk.{}.attn_output.weight",
                   (2, "heads")),
    "ln2": ArraySpec(("L", "D"), "model.layers.{}.post_attention_layernorm.weight", "blk.{}.ffn_norm.weight"),
    "gate": ArraySpec(("L", "F", "D"), "model.layers.{}.mlp.gate_proj.weight", "blk.{}.ffn_gate.weight",
                      (1, "ffn")),
    "up": ArraySpec(("L", "F", "D"), "model.layers.{}.mlp.up_proj.weight", "blk.{}.ffn_up.weight",
                    (1, "ffn")),
    "down": ArraySpec(("L", "D", "F"), "model.layers.{}.mlp.down_proj.weight", "blk.{}.ffn_down.weight",
                      (2, "ffn")),
})  # fmt: skip
LAYER_MATRICES = tuple(f for f, spec in LAYER.items() if len(spec.axes) == 3)  # q, k, v, o, gate, up, down
LAYER.update({  # the switches' arrays (`ArraySpec.present`): a bias per matrix (by its output rows), per-head norms
    **{f"{m}_bias": ArraySpec(("L", LAYER[m].axes[1]), LAYER[m].hf.replace(".weight", ".bias"),
                              LAYER[m].gguf.replace(".weight", ".bias"),
                              (1, LAYER[m].split[1]) if LAYER[m].split[0] == 1 else None, bias_of=m)
       for m in LAYER_MATRICES},
    "q_norm": ArraySpec(("L", "H"), "model.layers.{}.self_attn.q_norm.weight", "blk.{}.attn_q_norm.weight",
                        head_norm=True),
    "k_norm": ArraySpec(("L", "H"), "model.layers.{}.self_attn.k_norm.weight", "blk.{}.attn_k_norm.weight",
                        head_norm=True),
})  # fmt: skip
MODEL = Table(
    {  # Weights' own fields
        "emb": ArraySpec(("V", "D"), "model.embed_tokens.weight", "token_embd.weight"),
        "lnf": ArraySpec(("D",), "model.norm.weight", "output_norm.weight"),
        "lm_head": ArraySpec(("V", "D"), "lm_head.weight", "output.weight"),  # absent when tied
    }
)
# the tensors in which some families' checkpoints hold several of a layer's matrices, their rows in this order
# (Phi-3's qkv_proj and gate_up_proj; llama.cpp's phi3 attn_qkv, and ffn_up holding gate then up): (Hugging Face
# name, GGUF name, the fields), split on load into the fields' own arrays
FUSED = (
    ("model.layers.{}.self_attn.qkv_proj.weight", "blk.{}.attn_qkv.weight", ("q", "k", "v")),
    ("model.layers.{}.mlp.gate_up_proj.weight", "blk.{}.ffn_up.weight", ("gate", "up")),
)
FUSED_FAMILIES = ("phi3",)
ROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")  # a GGUF's longrope factors [P]: the config's
ROPE_FREQS = "rope_freqs.weight"  # a GGUF's RoPE frequency divisors [P]: read into the config, not a weight
CACHE = ArraySpec(("L", "B", "K", "S", "H"), split=(2, "heads"))  # KVCache.k and .v
CACHE_DATA_AXIS = 1  # the cache's batch axis, split over a mesh's data axis


def splits(unit: str, config: LlamaConfig, model_size: int) -> bool:
    """Whether a model axis of model_size divides the unit evenly (else the array is replicated)."""
    if unit == "heads":
        return config.heads % model_size == 0 and config.kv % model_size == 0
    return config.ffn % model_size == 0


def checkpoint_arrays(config: LlamaConfig) -> dict[str, tuple[str, ArraySpec, int | None]]:
    """Every tensor of a checkpoint of this config, by Hugging Face name: (field, spec, layer or None)."""
    out = {MODEL[f].hf: (f, MODEL[f], None) for f in ("emb", "lnf")}
    if not config.tied:
        out[MODEL["lm_head"].hf] = ("lm_head", MODEL["lm_head"], None)
    for i in range(config.layers):
        for field, spec in LAYER.items():
            if spec.present(config):
                out[spec.hf.format(i)] = (field, spec, i)
    return out
