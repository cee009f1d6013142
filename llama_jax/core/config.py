"""The model's sizes: a frozen, hashable config, so `jax.jit` specialises on it as a static argument.

Field names follow the spec (`Cfg` in main.bend): kv key/value heads, g query heads per key/value head, half
half a head, ffn the MLP's inner width, layers, vocab, eps (RMSNorm), theta (RoPE's base). Every other size is
derived: head = 2·half, heads = kv·g, dim = heads·head, kvw = kv·head (the width of the keys and values).

The package's one shape alphabet, in shape comments (`# [B, T, K, G, H]`) and jaxtyping annotations alike:
  B batch, T positions of a block (query positions; a decode chunk's new tokens), S cache slots (key
  positions; the axis a softmax sums), W the slots attended to (the attention window), L layers, D dim,
  K kv heads, G query heads per kv head (g), N query heads, E heads of either kind (N or K), H head size,
  P half a head (RoPE's pairs), F ffn, V vocab, C kv width (kvw), Y a site's width (D, C or F); a matrix's
  O output rows and I input columns, Q its ggml blocks of 32 per row; *A any leading axes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from llama_jax.errors import ConfigError


def _f32(x: float) -> float:
    """x rounded to float32 and back: the spec's eps and theta are F32, whatever file they came from."""
    return float(np.float32(x))


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The sizes of a Llama-architecture model (the spec's `Cfg`), plus two facts of the checkpoint.

    tied: whether the LM head is the embedding matrix (SmolLM2: yes). context: the longest context the model
    was trained for, the default capacity of a KV cache.
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

    def __post_init__(self) -> None:
        for name in ("kv", "g", "half", "ffn", "layers", "vocab", "context"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        if not (np.isfinite(self.eps) and self.eps > 0):
            raise ConfigError(f"config field eps must be a positive finite number, got {self.eps!r}")
        if not (np.isfinite(self.theta) and self.theta > 1):
            raise ConfigError(f"config field theta must be a finite number above 1, got {self.theta!r}")
        object.__setattr__(self, "eps", _f32(self.eps))
        object.__setattr__(self, "theta", _f32(self.theta))

    @property
    def head(self) -> int:
        """The size of a head: 2·half numbers, the two halves that RoPE pairs up."""
        return 2 * self.half

    @property
    def heads(self) -> int:
        """The query heads: kv groups of g."""
        return self.kv * self.g

    @property
    def dim(self) -> int:
        """The hidden size: one head per query head."""
        return self.heads * self.head

    @property
    def kvw(self) -> int:
        """The width of the keys (and of the values): one head per key/value head."""
        return self.kv * self.head

    def layer_size(self) -> int:
        """The numbers of one layer: two norms, q and o (dim × dim), k and v (kvw × dim), gate, up, down."""
        d = self.dim
        return 2 * d + 2 * d * d + 2 * self.kvw * d + 3 * self.ffn * d

    def param_count(self) -> int:
        """The numbers of the model: the embedding, the layers, the final norm (and an untied LM head)."""
        head = 0 if self.tied else self.vocab * self.dim
        return self.vocab * self.dim + self.layers * self.layer_size() + self.dim + head

    # ---- Hugging Face config.json ----

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], source: str = "config.json") -> LlamaConfig:
        """The config of a Hugging Face `config.json` (as a dict); refuses features the port does not run: the
        known ones by name (biases, RoPE scaling, sliding windows, ...), and any field it does not know that holds
        more than an empty value (None, false, 0, "", [], {}), since it may change what the model computes."""
        f = _Fields(hf, source, "field ")
        model_type = hf.get("model_type", "llama")
        if model_type != "llama":
            raise ConfigError(f"{source}: model_type is {model_type!r}; llama-jax runs Llama-architecture models only")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{source}: hidden_act is {act!r}; only SwiGLU with silu is supported")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ConfigError(f"{source}: {flag} is true; projections with a bias are not supported")
        if hf.get("sliding_window"):
            raise ConfigError(f"{source}: sliding_window is set; only full causal attention is supported")
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        if not isinstance(rope, Mapping):
            raise ConfigError(f"{source}: rope_scaling is {rope!r}, not an object; only the default RoPE is supported")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{source}: RoPE scaling {rope_type!r} is not supported; only the default RoPE is")
        if hf.get("pretraining_tp", 1) != 1:
            raise ConfigError(f"{source}: pretraining_tp {hf['pretraining_tp']} is not supported; use 1")
        unknown = [k for k, v in hf.items() if k not in HF_READ | HF_METADATA and v not in (None, False, 0, "", [], {})]
        if unknown:
            raise ConfigError(
                f"{source}: field {unknown[0]!r} ({hf[unknown[0]]!r:.60}) is not a setting of the Llama architecture"
                " that llama-jax knows, and it may change what the model computes; remove it if it does not"
            )

        dim = f.int("hidden_size")
        heads = f.int("num_attention_heads")
        kv = f.int("num_key_value_heads", heads) if hf.get("num_key_value_heads") is not None else heads
        if heads < 1 or kv < 1 or heads % kv:
            raise ConfigError(
                f"{source}: num_attention_heads {heads} is not a positive multiple of num_key_value_heads {kv}"
            )
        if dim % heads:
            raise ConfigError(f"{source}: hidden_size {dim} is not a multiple of num_attention_heads {heads}")
        head = dim // heads
        if hf.get("head_dim") not in (None, head):
            raise ConfigError(
                f"{source}: head_dim {hf['head_dim']} does not equal hidden_size / num_attention_heads = {head};"
                " heads of another size are not supported"
            )
        if head % 2:
            raise ConfigError(f"{source}: the head size {head} is odd; RoPE needs two halves of equal size")
        theta = f.float("rope_theta", None)
        theta = _Fields(rope, source, "rope_parameters field ").float("rope_theta", 10000.0) if theta is None else theta
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
            context=f.int("max_position_embeddings", 2048),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> LlamaConfig:
        """The config of a `config.json` file."""
        return cls.from_hf(read_config_json(path), source=str(path))

    def to_hf(self) -> dict[str, Any]:
        """This config as a Hugging Face `config.json` dict (LlamaForCausalLM)."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            "hidden_size": self.dim,
            "intermediate_size": self.ffn,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv,
            "head_dim": self.head,
            "num_hidden_layers": self.layers,
            "vocab_size": self.vocab,
            "rms_norm_eps": self.eps,
            "rope_theta": self.theta,
            "rope_scaling": None,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": self.tied,
            "max_position_embeddings": self.context,
        }

    # ---- GGUF metadata ----

    @classmethod
    def from_gguf(cls, meta: Mapping[str, Any], tied: bool, source: str) -> LlamaConfig:
        """The config of a GGUF file's metadata; tied: whether the file lacks a separate `output.weight`."""
        arch = meta.get("general.architecture")
        if arch != "llama":
            raise ConfigError(f"{source}: general.architecture is {arch!r}; llama-jax runs 'llama' models only")

        f = _Fields(meta, source, "metadata key ")
        scaling = meta.get("llama.rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise ConfigError(f"{source}: RoPE scaling {scaling!r} is not supported; only the default RoPE is")
        dim = f.int("llama.embedding_length")
        heads = f.int("llama.attention.head_count")
        kv = f.int("llama.attention.head_count_kv", heads)
        if heads < 1 or kv < 1 or heads % kv or dim % heads or (dim // heads) % 2:
            raise ConfigError(
                f"{source}: {heads} query heads, {kv} key/value heads and embedding_length {dim} do not make"
                " kv groups of equal heads of even size"
            )
        head = dim // heads
        rope_dim = f.int("llama.rope.dimension_count", head)
        if rope_dim != head:
            raise ConfigError(f"{source}: rope.dimension_count {rope_dim} is not the head size {head}")
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
            context=f.int("llama.context_length", 2048),
        )


# config.json's fields: those from_hf reads or refuses by name, and those that say nothing about what the model
# computes (names, ids the tokenizer has too, how transformers stores or initializes it, its output options)
HF_READ = frozenset({
    "model_type", "hidden_act", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "num_hidden_layers", "vocab_size", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters",
    "tie_word_embeddings", "max_position_embeddings", "attention_bias", "mlp_bias", "sliding_window",
    "pretraining_tp",
})  # fmt: skip
HF_METADATA = frozenset({
    "architectures", "_name_or_path", "transformers_version", "torch_dtype", "dtype", "initializer_range",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "attention_dropout",
    "id2label", "label2id", "output_attentions", "output_hidden_states", "return_dict", "is_encoder_decoder",
    "chunk_size_feed_forward", "problem_type", "tokenizer_class",
    "is_llama_config", "transformers.js_config",  # SmolLM2's own (nanotron's conversion; its rope_interleaved is false)
})  # fmt: skip


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
