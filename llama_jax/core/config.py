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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from llama_jax.core.rope_scaling import DEFAULT_ROPE, RopeScaling
from llama_jax.errors import ConfigError


def _f32(x: float) -> float:
    """x rounded to float32 and back: the spec's eps and theta are F32, whatever file they came from."""
    return float(np.float32(x))


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The sizes of a Llama-architecture model (the spec's `Cfg`), plus five facts of the checkpoint.

    tied: whether the LM head is the embedding matrix (SmolLM2: yes). context: the longest context the model
    was trained for, the default capacity of a KV cache. rope: how RoPE's frequencies are scaled (none by default).
    dim: the hidden size, heads·head (qw) unless given (a checkpoint whose head_dim is not hidden_size / heads).
    sliding_window: Mistral's window: a query sees its own and the window - 1 positions before it (None: all).
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

    def __post_init__(self) -> None:
        if self.dim is None:
            object.__setattr__(self, "dim", self.qw)
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

    def layer_size(self) -> int:
        """The numbers of one layer: two norms, q and o (qw × dim), k and v (kvw × dim), gate, up, down."""
        d = self.dim
        return 2 * d + 2 * self.qw * d + 2 * self.kvw * d + 3 * self.ffn * d

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
        model_type = hf.get("model_type", "llama")
        if model_type not in ("llama", "mistral"):
            raise ConfigError(
                f"{source}: model_type is {model_type!r}; llama-jax runs Llama-architecture models only (llama,"
                " mistral)"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act is {act!r}; only SwiGLU with silu is supported")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ConfigError(f"{source}: {flag} is true; projections with a bias are not supported")
        if hf.get("sliding_window") and model_type != "mistral":  # LlamaForCausalLM would ignore it
            raise ConfigError(f"{source}: sliding_window is set for a {model_type} model; only Mistral's is run")
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        if not isinstance(rope, Mapping):
            raise ConfigError(f"{source}: rope_scaling is {rope!r}, not an object of RoPE scaling fields")
        computing = [k for k, v in hf.items() if k in HF_COMPUTES and v not in (None, False, 0, "", [], {})]
        if computing:
            key = computing[0]
            raise ConfigError(
                f"{source}: field {key!r} ({hf[key]!r:.60}) is {HF_COMPUTES[key]}, which llama-jax does not"
                " compute; transformers' LlamaForCausalLM would ignore it, but a checkpoint carrying it was made to"
                " compute with it. Remove the field if it does not apply to these weights"
            )

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
            rope=RopeScaling.from_hf(rope, context, source),
            dim=dim,
            sliding_window=f.int("sliding_window", None) if model_type == "mistral" else None,
        )

    @classmethod
    def from_file(cls, path: str | Path) -> LlamaConfig:
        """The config of a `config.json` file."""
        return cls.from_hf(read_config_json(path), source=str(path))

    def to_hf(self) -> dict[str, Any]:
        """This config as a Hugging Face `config.json` dict (LlamaForCausalLM; MistralForCausalLM with a sliding
        window)."""
        mistral = self.sliding_window is not None
        return {
            "architectures": ["MistralForCausalLM" if mistral else "LlamaForCausalLM"],
            "model_type": "mistral" if mistral else "llama",
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
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": self.tied,
            "max_position_embeddings": self.context,
        } | ({"sliding_window": self.sliding_window} if mistral else {})

    # ---- GGUF metadata ----

    @classmethod
    def from_gguf(
        cls, meta: Mapping[str, Any], tied: bool, source: str, rope_freqs: np.ndarray | None = None
    ) -> LlamaConfig:
        """The config of a GGUF file's metadata; tied: whether the file lacks a separate `output.weight`;
        rope_freqs: its `rope_freqs.weight` tensor, if it has one (RoPE's frequency divisors)."""
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ConfigError(f"{source}: general.architecture is {arch!r}; llama-jax runs 'llama' models only")

        f = _Fields(meta, source, "metadata key ")
        dim = f.int("llama.embedding_length")
        heads = f.int("llama.attention.head_count")
        kv = f.int("llama.attention.head_count_kv", heads)
        default_head = dim // heads if heads > 0 and dim % heads == 0 else None
        head = f.int("llama.attention.key_length", default_head)  # llama.cpp's head size, where it is not dim / heads
        value_head = f.int("llama.attention.value_length", head)
        if heads < 1 or kv < 1 or heads % kv or head is None or head < 1 or head % 2 or value_head != head:
            raise ConfigError(
                f"{source}: {heads} query heads, {kv} key/value heads, embedding_length {dim} and head size"
                f" {head} (value {value_head}) do not make kv groups of equal heads of even size"
            )
        rope_dim = f.int("llama.rope.dimension_count", head)
        if rope_dim != head:
            raise ConfigError(f"{source}: rope.dimension_count {rope_dim} is not the head size {head}")
        context = f.int("llama.context_length", 2048)
        if "llama.vocab_size" in meta:
            vocab = f.int("llama.vocab_size")
        elif isinstance(meta.get("tokenizer.ggml.tokens"), list):
            vocab = len(meta["tokenizer.ggml.tokens"])
        else:
            raise ConfigError(f"{source}: neither llama.vocab_size nor tokenizer.ggml.tokens gives the vocabulary")
        return _build(
            source,
            kv=kv,
            g=heads // kv,
            half=head // 2,
            ffn=f.int("llama.feed_forward_length"),
            layers=f.int("llama.block_count"),
            vocab=vocab,
            eps=f.float("llama.attention.layer_norm_rms_epsilon"),
            theta=f.float("llama.rope.freq_base", 10000.0),
            tied=tied,
            context=context,
            rope=RopeScaling.from_gguf(meta, context, rope_freqs, source),
            dim=dim,
        )


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
    "partial_rotary_factor": "a RoPE over part of each head",
    "rope_interleaved": "an interleaved RoPE (pairs of neighbours, GPT-J's)",
    "use_qk_norm": "a norm of queries and keys", "qk_layernorm": "a norm of queries and keys",
    "num_experts": _EXPERTS, "num_local_experts": _EXPERTS, "num_experts_per_tok": _EXPERTS,
    "moe_intermediate_size": _EXPERTS,
    "layer_types": "attention kinds per layer", "use_sliding_window": "a sliding window of attention",
    "no_rope_layers": "layers without RoPE (Llama 4)", "attention_chunk_size": "chunked attention (Llama 4)",
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
