"""The model's sizes: a frozen, hashable config, so `jax.jit` specialises on it as a static argument.

Field names follow the spec (`Cfg` in main.bend): kv key/value heads, g query heads per key/value head, half
half a head, ffn the MLP's inner width, layers, vocab, eps (RMSNorm), theta (RoPE's base). Every other size is
derived: head_dim = 2·half (a head's size), heads = kv·g (a count), qw = heads·head_dim (the width of the
queries), kvw = kv·head_dim (the width of the keys and values), and dim = qw, the hidden size, unless a checkpoint
gives another (its head_dim is not hidden_size / heads: then q maps dim to qw and o qw back to dim).

The package's one shape alphabet, in shape comments (`# [B, T, K, G, H]`) and jaxtyping annotations alike:
  B batch, T positions of a block (query positions; a decode chunk's new tokens), S cache slots (key
  positions; the axis a softmax sums), W the slots attended to (the attention window), L layers, D dim,
  K kv heads, G query heads per kv head (g), N query heads, E heads of either kind (N or K), H head size,
  P half a head (RoPE's pairs), F ffn, V vocab, C kv width (kvw), M query width (qw), Y a site's width (D, M, C
  or F); a matrix's O output rows and I input columns, Q its ggml blocks of 32 per row; *A any leading axes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from llama_jax.core.rope_scaling import DEFAULT_ROPE, RopeScaling
from llama_jax.errors import ConfigError

# The compute tiers (`LlamaConfig.precision`, set by `llama_jax.load`, never by a checkpoint): "float32", every
# product in the float32 class; "bfloat16", every weight product's activations rounded to bf16 (docs/numerics.md)
PRECISIONS = ("float32", "bfloat16")


def _f32(x: float) -> float:
    """x rounded to float32 and back: the spec's eps and theta are F32, whatever file they came from."""
    return float(np.float32(x))


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The sizes of a Llama-architecture model (the spec's `Cfg`), plus the facts of the checkpoint that change
    what the one Llama block computes (each a switch it reads; the defaults are Llama's).

    tied: whether the LM head is the embedding matrix (SmolLM2: yes). context: the longest context the model
    was trained for, the default capacity of a KV cache. rope: how RoPE's frequencies are scaled (none by default).
    dim: the hidden size, heads·head (qw) unless given (a checkpoint whose head_dim is not hidden_size / heads).
    sliding_window: Mistral's window: a query sees its own and the window - 1 positions before it (None: all).
    family: the checkpoint's architecture (FAMILIES: Hugging Face's model_type, GGUF's general.architecture), which
    names its config fields and tensors; it computes nothing itself. biases: the layer matrices whose products add
    a bias (Qwen2: q, k, v; Llama's attention_bias: q, k, v, o; mlp_bias: gate, up, down). head_norms: an RMSNorm
    (eps, a gain of H) of each query and key head before RoPE (Qwen3's q_norm, k_norm). nope_layers: the layers
    whose queries and keys skip RoPE (SmolLM3: every fourth). Granite's scalars: embedding_multiplier (the
    embeddings times it), residual_multiplier (attention's and the MLP's outputs times it before each residual
    add), attention_multiplier (the scores' scale, 1/sqrt(head) when None) and logits_scaling (the logits divided
    by it); 1 (None) computes nothing. precision: the compute tier (PRECISIONS), a choice of the load, not of the
    checkpoint: with "bfloat16" the one block rounds each weight product's activations to bf16 (`nn.linear.tiered`).
    """

    kv: int
    g: int
    half: int
    ffn: int
    layers: int
    vocab: int
    eps: float = 1e-5
    theta: float = 10000.0
    tied: bool = True
    context: int = 2048
    rope: RopeScaling = DEFAULT_ROPE
    dim: int | None = None  # heads·head unless given: an int once made
    sliding_window: int | None = None
    family: str = "llama"
    biases: tuple[str, ...] = ()
    head_norms: bool = False
    nope_layers: tuple[int, ...] = ()
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    precision: str = "float32"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(
                f"precision {self.precision!r} is not a compute tier; choose one of {', '.join(PRECISIONS)}"
            )
        if self.dim is None:
            object.__setattr__(self, "dim", self.qw)
        if self.family in ("llama", "mistral"):  # Llama's checkpoints have no window: Mistral's do (else a Llama's)
            object.__setattr__(self, "family", "llama" if self.sliding_window is None else "mistral")
        if self.family not in FAMILIES:
            raise ConfigError(f"config field family is {self.family!r}; the families run are {', '.join(FAMILIES)}")
        if not isinstance(self.biases, tuple) or not set(self.biases) <= set(MATRICES):
            raise ConfigError(
                f"config field biases must be a tuple of matrix names among {MATRICES}, got {self.biases!r}"
            )
        object.__setattr__(self, "biases", tuple(m for m in MATRICES if m in self.biases))
        if not isinstance(self.nope_layers, tuple) or not all(
            isinstance(i, int) and 0 <= i < self.layers for i in self.nope_layers
        ):
            raise ConfigError(f"config field nope_layers must be a tuple of layer indices, got {self.nope_layers!r}")
        object.__setattr__(self, "nope_layers", tuple(sorted(set(self.nope_layers))))
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if value is None and name == "attention_multiplier":
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not (np.isfinite(value) and value > 0):
                raise ConfigError(f"config field {name} must be a positive finite number, got {value!r}")
            object.__setattr__(self, name, _f32(value))
        for name in ("kv", "g", "half", "ffn", "layers", "vocab", "context", "dim", "sliding_window"):
            value = getattr(self, name)
            if name == "sliding_window" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if not (np.isfinite(self.eps) and self.eps > 0):
            raise ConfigError(f"config field eps must be a positive finite number, got {self.eps!r}")
        if not (np.isfinite(self.theta) and self.theta > 1):
            raise ConfigError(f"config field theta must be a finite number above 1, got {self.theta!r}")
        object.__setattr__(self, "eps", _f32(self.eps))
        object.__setattr__(self, "theta", _f32(self.theta))
        if not isinstance(self.rope, RopeScaling):
            raise ConfigError(f"config field rope must be a RopeScaling, got {self.rope!r}")
        if self.rope.kind == "longrope" and len(self.rope.short_factor) != self.half:
            raise ConfigError(
                f"RoPE scaling 'longrope' has {len(self.rope.short_factor)} factors a list, not one per frequency"
                f" ({self.half}: half the head size)"
            )
        if self.rope.divisors and len(self.rope.divisors) != self.half:
            raise ConfigError(
                f"the RoPE frequency divisors (rope_freqs) are {len(self.rope.divisors)}, not one per frequency"
                f" ({self.half}: half the head size)"
            )

    @property
    def head_dim(self) -> int:
        """The size of a head: 2·half numbers, the two halves that RoPE pairs up."""
        return 2 * self.half

    @property
    def heads(self) -> int:
        """The query heads: kv groups of g."""
        return self.kv * self.g

    @property
    def qw(self) -> int:
        """The width of the queries (q's rows, o's columns, the heads' joined outputs): one head per query head."""
        return self.heads * self.head_dim

    @property
    def kvw(self) -> int:
        """The width of the keys (and of the values): one head per key/value head."""
        return self.kv * self.head_dim

    @property
    def attention_scale(self) -> float:
        """What the attention scores q·k are multiplied by: Granite's attention_multiplier, else 1/sqrt(head) (in
        float64, then rounded to float32, as transformers' `head_dim**-0.5` meets a float32 tensor)."""
        scale = 1.0 / math.sqrt(self.head_dim) if self.attention_multiplier is None else self.attention_multiplier
        return _f32(scale)

    @property
    def rope_layers(self) -> tuple[bool, ...]:
        """Per layer: whether its queries and keys take RoPE."""
        return tuple(i not in self.nope_layers for i in range(self.layers))

    def layer_size(self) -> int:
        """The numbers of one layer: two norms, q and o (qw × dim), k and v (kvw × dim), gate, up, down, and the
        biases and per-head norm gains it has."""
        d = self.dim
        widths = {"q": self.qw, "k": self.kvw, "v": self.kvw, "o": d, "gate": self.ffn, "up": self.ffn, "down": d}
        extra = sum(widths[m] for m in self.biases) + (2 * self.head_dim if self.head_norms else 0)
        return 2 * d + 2 * self.qw * d + 2 * self.kvw * d + 3 * self.ffn * d + extra

    def param_count(self) -> int:
        """The numbers of the model: the embedding, the layers, the final norm (and an untied LM head)."""
        head = 0 if self.tied else self.vocab * self.dim
        return self.vocab * self.dim + self.layers * self.layer_size() + self.dim + head

    # ---- Hugging Face config.json ----

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> LlamaConfig:
        """The config of a Hugging Face `config.json` (as a dict). The rule for its fields is transformers': what
        LlamaForCausalLM reads is read (and refused by name where llama-jax does not run its value: biases, sliding
        windows, ...); what it ignores is ignored (a fine-tuning tool's metadata: unsloth_version, ...), except the
        fields of related architectures that compute (HF_COMPUTES: softcapping, multipliers, experts, quantized
        weights, ...), which a checkpoint holds because it was made to compute with them: those are refused by
        name unless empty (None, false, 0, "", [], {})."""
        f = _Fields(hf, source, "field ")
        family = hf.get("model_type", "llama")
        if family not in HF_FAMILIES:
            refused = f"; {NOT_YET[family]}, which llama-jax does not compute yet" if family in NOT_YET else ""
            raise ConfigError(
                f"{source}: model_type is {family!r}{refused}; llama-jax runs the Llama-architecture families"
                f" {', '.join(HF_FAMILIES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act is {act!r}; only SwiGLU with silu is supported")
        windowed = family in WINDOWED
        if hf.get("sliding_window") and not windowed and not _family_ignores_window(family, hf):
            raise ConfigError(
                f"{source}: sliding_window is set for a {family} model, which transformers would run; only"
                " Mistral's window is run"
            )
        layer_types = hf.get("layer_types") or []
        if any(kind != "full_attention" for kind in layer_types):
            raise ConfigError(
                f"{source}: layer_types {sorted(set(layer_types))} has layers of sliding attention; only full"
                " attention in every layer is run"
            )
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        if not isinstance(rope, Mapping):
            raise ConfigError(f"{source}: rope_scaling is {rope!r}, not an object of RoPE scaling fields")
        read = HF_FAMILIES[family]
        computing = [
            k for k, v in hf.items() if k in HF_COMPUTES and k not in read and v not in (None, False, 0, "", [], {})
        ]
        if computing:
            key = computing[0]
            raise ConfigError(
                f"{source}: field {key!r} ({hf[key]!r:.60}) is {HF_COMPUTES[key]}, which llama-jax does not"
                f" compute; transformers' {family} model would ignore it, but a checkpoint carrying it was made to"
                " compute with it. Remove the field if it does not apply to these weights"
            )
        switches = _hf_switches(family, hf, f, source)

        dim = f.int("hidden_size")
        heads = f.int("num_attention_heads")
        kv = f.int("num_key_value_heads", heads) if hf.get("num_key_value_heads") is not None else heads
        if heads < 1 or kv < 1 or heads % kv:
            raise ConfigError(
                f"{source}: num_attention_heads {heads} is not a positive multiple of num_key_value_heads {kv}"
            )
        if hf.get("head_dim") is not None:  # transformers' rule: head_dim if given, else hidden_size / heads
            head = f.int("head_dim")
        elif dim % heads:
            raise ConfigError(f"{source}: hidden_size {dim} is not a multiple of num_attention_heads {heads}")
        else:
            head = dim // heads
        if head < 1 or head % 2:
            raise ConfigError(f"{source}: the head size {head} is not a positive even number; RoPE pairs two halves")
        theta = f.float("rope_theta", None)
        theta = _Fields(rope, source, "rope_parameters field ").float("rope_theta", 10000.0) if theta is None else theta
        context = f.int("max_position_embeddings", 2048)
        return _build(
            source,
            kv=kv,
            g=heads // kv,
            half=head // 2,
            ffn=f.int("intermediate_size"),
            layers=f.int("num_hidden_layers"),
            vocab=f.int("vocab_size"),
            eps=f.float("rms_norm_eps", 1e-6),
            theta=theta,
            tied=bool(hf.get("tie_word_embeddings", False)),
            context=context,
            rope=RopeScaling.from_hf(rope, context, source, _original_context(family, hf, f)),
            dim=dim,
            sliding_window=f.int("sliding_window", None) if windowed else None,
            family=family,
            **switches,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> LlamaConfig:
        """The config of a `config.json` file."""
        return cls.from_hf(read_config_json(path), source=str(path))

    def to_hf(self) -> dict[str, Any]:
        """This config as a Hugging Face `config.json` dict of its family (LlamaForCausalLM, MistralForCausalLM,
        Qwen2ForCausalLM, ...): ConfigError where that family's fields cannot say it (a switch it lacks)."""
        hf: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.family]],
            "model_type": self.family,
            "hidden_act": "silu",
            "hidden_size": self.dim,
            "intermediate_size": self.ffn,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.layers,
            "vocab_size": self.vocab,
            "rms_norm_eps": self.eps,
            "rope_theta": self.theta,
            "rope_scaling": self.rope.to_hf(),
            "tie_word_embeddings": self.tied,
            "max_position_embeddings": self.context,
        }
        said = {"attention_bias": set(_ATTENTION) <= set(self.biases), "mlp_bias": set(_MLP) <= set(self.biases)}
        if self.family in WINDOWED:
            hf["sliding_window"] = self.sliding_window
        if self.family == "smollm3":
            hf["no_rope_layers"] = [int(use) for use in self.rope_layers]
        if self.family == "phi3" and self.rope.original_context:
            hf["original_max_position_embeddings"] = self.rope.original_context
        if self.family == "granite":
            hf |= {n: getattr(self, n) for n in ("embedding_multiplier", "residual_multiplier", "logits_scaling")}
            hf["attention_multiplier"] = self.attention_scale
        hf |= {k: v for k, v in said.items() if k in HF_FAMILIES[self.family]}
        switches = _hf_switches(self.family, hf, _Fields(hf, "", ""), "")
        if "attention_multiplier" in switches and switches["attention_multiplier"] == self.attention_scale:
            switches["attention_multiplier"] = self.attention_multiplier  # None and 1/sqrt(head) say the same
        if dataclasses.replace(self, **switches) != self:
            raise ConfigError(f"a {self.family} config.json cannot hold this config's switches ({self})")
        return hf

    # ---- GGUF metadata ----

    @classmethod
    def from_gguf(
        cls,
        meta: Mapping[str, Any],
        tied: bool,
        source: str,
        rope_freqs: np.ndarray | None = None,
        biases: tuple[str, ...] = (),
        rope_factors: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> LlamaConfig:
        """The config of a GGUF file's metadata, its keys under its architecture's name (`{arch}.block_count`, ...)
        as llama.cpp's converter writes them; tied: whether the file lacks a separate `output.weight`; rope_freqs:
        its `rope_freqs.weight` tensor, if it has one (RoPE's frequency divisors); biases: the matrices whose bias
        tensors the file holds (read from its tensors by the loader); rope_factors: its longrope factors (short,
        long), if any.
        The switches of each architecture are llama.cpp's: qwen3's per-head norms, smollm3's layers without RoPE
        (every fourth: llama.cpp's fixed step, no key says it), granite's scalars (`granite.embedding_scale`,
        `residual_scale`, `attention.scale`, `logit_scale`), phi3's window (`phi3.attention.sliding_window`)."""
        arch = meta.get("general.architecture")
        if arch not in GGUF_FAMILIES:
            raise ConfigError(
                f"{source}: general.architecture is {arch!r}; llama-jax runs the architectures"
                f" {', '.join(GGUF_FAMILIES)}"
            )

        f, p = _Fields(meta, source, "metadata key "), f"{arch}."
        dim = f.int(p + "embedding_length")
        heads = f.int(p + "attention.head_count")
        kv = f.int(p + "attention.head_count_kv", heads)
        default_head = dim // heads if heads > 0 and dim % heads == 0 else None
        head = f.int(p + "attention.key_length", default_head)  # llama.cpp's head size, where it is not dim / heads
        value_head = f.int(p + "attention.value_length", head)
        if heads < 1 or kv < 1 or heads % kv or head is None or head < 1 or head % 2 or value_head != head:
            raise ConfigError(
                f"{source}: {heads} query heads, {kv} key/value heads, embedding_length {dim} and head size"
                f" {head} (value {value_head}) do not make kv groups of equal heads of even size"
            )
        rope_dim = f.int(p + "rope.dimension_count", head)
        if rope_dim != head:
            raise ConfigError(f"{source}: rope.dimension_count {rope_dim} is not the head size {head}")
        context = f.int(p + "context_length", 2048)
        if p + "vocab_size" in meta:
            vocab = f.int(p + "vocab_size")
        elif isinstance(meta.get("tokenizer.ggml.tokens"), list):
            vocab = len(meta["tokenizer.ggml.tokens"])
        else:
            raise ConfigError(f"{source}: neither {p}vocab_size nor tokenizer.ggml.tokens gives the vocabulary")
        layers = f.int(p + "block_count")
        switches: dict[str, Any] = {
            "biases": biases,
            "head_norms": arch == "qwen3",
        }
        if arch == "smollm3":
            switches["nope_layers"] = tuple(i for i in range(max(layers, 0)) if (i + 1) % 4 == 0)
        if arch == "phi3":  # llama.cpp's converter writes Phi-3's window (none: 0)
            switches["sliding_window"] = f.int(p + "attention.sliding_window", 0) or None
        if arch == "granite":
            switches |= {
                "embedding_multiplier": f.float(p + "embedding_scale", 1.0),
                "residual_multiplier": f.float(p + "residual_scale", 1.0),
                "attention_multiplier": f.float(p + "attention.scale", None),
                "logits_scaling": f.float(p + "logit_scale", 1.0),
            }
        return _build(
            source,
            kv=kv,
            g=heads // kv,
            half=head // 2,
            ffn=f.int(p + "feed_forward_length"),
            layers=layers,
            vocab=vocab,
            eps=f.float(p + "attention.layer_norm_rms_epsilon"),
            theta=f.float(p + "rope.freq_base", 10000.0),
            tied=tied,
            context=context,
            rope=RopeScaling.from_gguf(meta, context, rope_freqs, source, arch, rope_factors),
            dim=dim,
            family=arch,
            **switches,
        )


MATRICES = ("q", "k", "v", "o", "gate", "up", "down")  # a layer's matrices, in the order a layer multiplies by them
_ATTENTION, _MLP = ("q", "k", "v", "o"), ("gate", "up", "down")

# the families llama-jax runs, by Hugging Face model_type: the fields of HF_COMPUTES each one reads (they are its
# switches, not refused); every family reads the Llama fields (sizes, RoPE, norms, a tied head)
HF_FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ("attention_bias", "mlp_bias"),
    "mistral": (),
    "qwen2": (),  # q, k and v always with a bias, o without
    "qwen3": ("attention_bias",),  # and q_norm, k_norm always
    "smollm3": ("attention_bias", "mlp_bias", "no_rope_layers"),
    "granite": ("attention_bias", "mlp_bias", "embedding_multiplier", "residual_multiplier", "attention_multiplier",
                "logits_scaling"),
    "phi3": (),  # q, k, v and gate, up fused in its checkpoints (`arrays.FUSED`); its sliding_window always read
}  # fmt: skip
FAMILIES = tuple(HF_FAMILIES)
WINDOWED = ("mistral", "phi3")  # the families whose sliding_window transformers reads as it is
GGUF_FAMILIES = ("llama", "qwen2", "qwen3", "smollm3", "granite", "phi3")  # general.architecture (Mistral: llama)

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

# related architectures refused by name, with what they compute that the Llama block does not
NOT_YET = {
    "gemma": "Gemma's (1 + w) norms and scaled embeddings", "gemma2": "Gemma 2's soft-capping and post-norms",
    "gemma3": "Gemma 3's sliding layers and post-norms", "olmo2": "OLMo 2's post-norms",
    "mixtral": "a mixture of experts", "qwen2_moe": "a mixture of experts", "qwen3_moe": "a mixture of experts",
    "granitemoe": "a mixture of experts", "llama4": "a mixture of experts and chunked attention (Llama 4)",
}  # fmt: skip


def _original_context(family: str, hf: Mapping[str, Any], f: _Fields) -> int | None:
    """Phi-3's top-level original_max_position_embeddings (Phi3Config's default 4096), which its config puts over
    the RoPE scaling's own; None for the other families (their scaling's field, where it has one)."""
    return f.int("original_max_position_embeddings", 4096) if family == "phi3" else None


def _family_ignores_window(family: str, hf: Mapping[str, Any]) -> bool:
    """Whether transformers' model of this family ignores the config's sliding_window: Qwen's and SmolLM3's read it
    only with use_sliding_window."""
    return family in ("qwen2", "qwen3", "smollm3") and not hf.get("use_sliding_window")


def _hf_switches(family: str, hf: Mapping[str, Any], f: _Fields, source: str) -> dict[str, Any]:
    """The config's switches of the Llama block (biases, per-head norms, layers without RoPE, Granite's scalars)
    from a family's config.json, as transformers' model of that family reads them."""
    biases = _ATTENTION if hf.get("attention_bias") else ("q", "k", "v") if family == "qwen2" else ()
    biases += _MLP if hf.get("mlp_bias") else ()
    out: dict[str, Any] = {"biases": biases, "head_norms": family == "qwen3"}
    if family == "smollm3":
        layers = f.int("num_hidden_layers")
        uses_rope = hf.get("no_rope_layers")  # per layer: 1 where it takes RoPE (transformers' naming)
        if uses_rope is None:
            interval = f.int("no_rope_layer_interval", 4)
            if interval < 1:
                raise ConfigError(f"{source}: no_rope_layer_interval is {interval}; expected a positive integer")
            uses_rope = [int((i + 1) % interval != 0) for i in range(layers)]
        if not isinstance(uses_rope, list) or len(uses_rope) != layers or any(u not in (0, 1) for u in uses_rope):
            raise ConfigError(
                f"{source}: no_rope_layers is {uses_rope!r:.80}; expected one 0 or 1 per layer ({layers}), 1 where"
                " the layer takes RoPE"
            )
        out["nope_layers"] = tuple(i for i, u in enumerate(uses_rope) if not u)
    if family == "granite":
        for name in ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling"):
            out[name] = f.float(name, 1.0)  # GraniteConfig's defaults: 1.0 each (the attention's too)
    return out


# config.json fields of architectures related to Llama that change what a model computes, by what they are:
# from_hf refuses each by name (transformers' LlamaForCausalLM would ignore them); any other field it does not read
# is metadata (names, ids, a tool's version, output options), ignored as transformers ignores it
_SOFTCAP = "a softcapping of logits (Gemma)"
_SCALE = "a scale of embeddings, residuals, attention or logits (Granite, MiniCPM)"
_EXPERTS = "a mixture of experts"
HF_COMPUTES = {
    "quantization_config": "a quantization of the weights (GPTQ, AWQ, bitsandbytes, ...)",
    "final_logit_softcapping": _SOFTCAP, "attn_logit_softcapping": _SOFTCAP, "logit_softcapping": _SOFTCAP,
    "query_pre_attn_scalar": "an attention scale other than 1/sqrt(head) (Gemma)",
    "embedding_multiplier": _SCALE, "residual_multiplier": _SCALE, "attention_multiplier": _SCALE,
    "logits_scaling": _SCALE, "scale_emb": _SCALE, "scale_depth": _SCALE, "dim_model_base": _SCALE,
    "partial_rotary_factor": "a RoPE over part of each head", "use_mrope": "a multimodal RoPE (Qwen2-VL's)",
    "attention_bias": "a bias of the attention's projections", "mlp_bias": "a bias of the MLP's projections",
    "rope_interleaved": "an interleaved RoPE (pairs of neighbours, GPT-J's)",
    "use_qk_norm": "a norm of queries and keys", "qk_layernorm": "a norm of queries and keys",
    "num_experts": _EXPERTS, "num_local_experts": _EXPERTS, "num_experts_per_tok": _EXPERTS,
    "moe_intermediate_size": _EXPERTS,
    "use_sliding_window": "a sliding window of attention",
    "no_rope_layers": "layers without RoPE", "attention_chunk_size": "chunked attention (Llama 4)",
    "parallel_attn": "attention and MLP in parallel", "use_parallel_residual": "attention and MLP in parallel",
}  # fmt: skip


def read_config_json(path: str | Path) -> dict[str, Any]:
    """A config.json file as a dict: ConfigError naming the file if it is missing, unreadable or not an object."""
    path = Path(path)
    try:
        hf = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise ConfigError(f"{path}: no such config file") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not a readable JSON config ({e})") from e
    if not isinstance(hf, dict):
        raise ConfigError(f"{path}: expected a JSON object, found {type(hf).__name__}")
    return hf


_REQUIRED = object()


class _Fields:
    """Typed reads of a config dict or GGUF metadata: a missing or mistyped entry is a ConfigError naming it."""

    def __init__(self, data: Mapping[str, Any], source: str, what: str):
        self.data, self.source, self.what = data, source, what

    def _get(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _REQUIRED:
            raise ConfigError(f"{self.source}: missing {self.what}{key!r}, which a Llama config must have")
        return default

    def int(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if value is not default and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"{self.source}: {self.what}{key!r} is {value!r}; expected an integer")
        return value

    def float(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if value is not default and (isinstance(value, bool) or not isinstance(value, int | float)):
            raise ConfigError(f"{self.source}: {self.what}{key!r} is {value!r}; expected a number")
        return value if value is None else float(value)


def _build(source: str, **fields: Any) -> LlamaConfig:
    """LlamaConfig(**fields), its own checks' errors prefixed with the source."""
    try:
        return LlamaConfig(**fields)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e
