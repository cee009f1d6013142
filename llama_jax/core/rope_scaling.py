"""RoPE's frequency scalings: how a checkpoint stretches the rotation frequencies it was trained with to a longer
context. A frozen, hashable part of the config (so `jax.jit` specialises on it); `nn/rope.py` computes the
frequencies from it.

The kinds are transformers' `rope_type`s for Llama (`modeling_rope_utils.py`) and llama.cpp's GGUF forms:
  default  1 / theta^(2i/head)
  linear   default / factor (position interpolation)
  dynamic  NTK-aware: theta grows with the sequence past the trained context; within it (the only lengths
           llama-jax runs: the context check refuses longer inputs) it is the default's frequencies
  llama3   Llama 3.1's: low frequencies / factor, high ones kept, a smooth ramp between
  yarn     YaRN: a ramp between interpolated and kept frequencies over the head's dimensions, and cos and sin
           scaled by an attention factor
  longrope Phi-3's LongRoPE: 1 / (ext_i · theta^(2i/head)), ext the short factors for a sequence of at most the
           original context, the long ones past it (chosen per sequence and pass, as transformers chooses for a
           sequence alone), and cos and sin scaled by an attention factor
and, for any kind, `divisors`: a GGUF's `rope_freqs.weight` (llama.cpp divides frequency i by divisors[i]; the
form in which llama.cpp's converter stores llama3's scaling).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from llama_jax.errors import ConfigError

KINDS = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """One RoPE scaling. factor: how many times the trained context it stretches to (linear, dynamic, llama3,
    yarn). original_context: the context the frequencies were trained at (llama3, yarn). low/high_freq_factor:
    llama3's band edges. beta_fast, beta_slow, truncate: yarn's ramp. attention_factor: yarn's scale of cos and
    sin, resolved from the checkpoint's fields (longrope's too). short_factor, long_factor: longrope's per-frequency
    factors. divisors: one per frequency (a GGUF's rope_freqs), or none."""

    kind: str = "default"
    factor: float = 1.0
    original_context: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    divisors: tuple[float, ...] = ()
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"RoPE scaling {self.kind!r} is not supported; the kinds llama-jax runs are {KINDS}")
        if self.kind != "default" and not (np.isfinite(self.factor) and self.factor > 0):
            raise ConfigError(f"RoPE scaling {self.kind!r} needs a positive factor, got {self.factor!r}")
        if self.kind in ("llama3", "yarn", "longrope") and self.original_context < 1:
            raise ConfigError(f"RoPE scaling {self.kind!r} needs original_max_position_embeddings")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ConfigError(
                f"RoPE scaling 'llama3' needs 0 < low_freq_factor < high_freq_factor, got {self.low_freq_factor}"
                f" and {self.high_freq_factor}"
            )
        if self.kind == "yarn" and not (self.beta_fast > 0 and self.beta_slow > 0 and self.attention_factor > 0):
            raise ConfigError(
                f"RoPE scaling 'yarn' needs positive beta_fast, beta_slow and attention factor, got {self.beta_fast},"
                f" {self.beta_slow} and {self.attention_factor}"
            )
        factors = (self.short_factor, self.long_factor)
        if self.kind == "longrope" and not (all(factors) and len(set(map(len, factors))) == 1):
            raise ConfigError("RoPE scaling 'longrope' needs short_factor and long_factor, one number a frequency each")
        if not all(np.isfinite(d) and d > 0 for d in (*self.divisors, *self.short_factor, *self.long_factor)):
            raise ConfigError("the RoPE frequency divisors (rope_freqs) must be positive finite numbers")

    @property
    def switch_length(self) -> int | None:
        """The sequence length past which a sequence's frequencies change for all its positions, cached ones too
        (longrope: its long factors past the original context), None where they never do. Generation that crosses
        it computes the sequence again (`DecodeBatch.advance`), as transformers' Phi-3 drops its cache there."""
        return self.original_context if self.kind == "longrope" else None

    def describe(self) -> str:
        """One line for `llama-jax info`: the kind, its factor and fields, the divisors' range."""
        text = "none" if self.kind == "default" else f"{self.kind} x{self.factor:g}"
        if self.kind == "llama3":
            text += f" (low {self.low_freq_factor:g}, high {self.high_freq_factor:g})"
        if self.kind in ("yarn", "longrope"):
            text += f" (attention factor {self.attention_factor:.6g})"
        if self.original_context:
            text += f", trained at {self.original_context} positions"
        if self.divisors:
            text += f"; rope_freqs divisors {min(self.divisors):g}..{max(self.divisors):g}"
        return text

    # ---- Hugging Face config.json ----

    @classmethod
    def from_hf(cls, rope: Mapping[str, Any], context: int, source: str, original: int | None = None) -> RopeScaling:
        """The scaling of a config.json's `rope_scaling` (or transformers 5's `rope_parameters`); context: its
        max_position_embeddings (yarn's and llama3's original context when they do not give one, as transformers);
        original: its top-level original_max_position_embeddings (Phi-3's), longrope's over the scaling's own (as
        Phi3Config standardizes them).
        The fields are transformers' (its `_validate_*_rope_parameters`): a kind's own are read; any other it ignores
        with a warning, and so does llama-jax (metadata: YaRN fine-tunes' `finetuned`, ...), except a field another
        kind computes with (`_COMPUTING`: llama3's low_freq_factor under yarn, ...), which is refused by name."""
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind not in KINDS:
            raise ConfigError(f"{source}: RoPE scaling {kind!r} is not supported; llama-jax runs {', '.join(KINDS)}")
        read = _Reader(rope, source, kind)
        known = {"rope_type", "type", "rope_theta"}
        if kind == "default":
            fields: dict[str, Any] = {}
        elif kind in ("linear", "dynamic"):
            fields = {"factor": read.number("factor")}
            known |= {"factor"}
        elif kind == "llama3":
            fields = {
                "factor": read.number("factor"),
                "low_freq_factor": read.number("low_freq_factor"),
                "high_freq_factor": read.number("high_freq_factor"),
                "original_context": read.integer("original_max_position_embeddings", context),
            }
            known |= {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}
        elif kind == "longrope":
            fields = _longrope_fields(read, context, original)
            known |= {"factor", "original_max_position_embeddings", "attention_factor", "short_factor", "long_factor"}
        else:
            fields = _yarn_fields(read, context)
            known |= {"factor", "original_max_position_embeddings", "attention_factor", "mscale", "mscale_all_dim"}
            known |= {"beta_fast", "beta_slow", "truncate"}
        partial = rope.get("partial_rotary_factor", 1.0)
        if partial != 1.0:
            raise ConfigError(f"{source}: partial_rotary_factor {partial!r} is not supported; RoPE rotates whole heads")
        foreign = sorted((set(rope) - known) & _COMPUTING)
        if foreign:
            raise ConfigError(
                f"{source}: RoPE scaling {kind!r} has the field {foreign[0]!r}, with which another kind of scaling"
                f" computes; a {kind} scaling does not read it (transformers would ignore it, so the checkpoint may"
                " have been made for another scaling). Remove the field if it does not apply"
            )
        try:
            return cls(kind, **fields)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from e

    def to_hf(self) -> dict[str, Any] | None:
        """As config.json's `rope_scaling` (None for the default); a GGUF's divisors have no config.json form."""
        if self.divisors:
            raise ConfigError(
                "this model's RoPE frequencies come from a GGUF's rope_freqs tensor, which has no config.json form"
            )
        if self.kind == "default":
            return None
        out: dict[str, Any] = {"rope_type": self.kind, "factor": self.factor}
        if self.kind == "llama3":
            out |= {"low_freq_factor": self.low_freq_factor, "high_freq_factor": self.high_freq_factor}
        if self.kind in ("llama3", "yarn"):
            out["original_max_position_embeddings"] = self.original_context
        if self.kind == "yarn":
            out |= {"beta_fast": self.beta_fast, "beta_slow": self.beta_slow, "truncate": self.truncate}
        if self.kind in ("yarn", "longrope"):
            out["attention_factor"] = self.attention_factor
        if self.kind == "longrope":
            out |= {"short_factor": list(self.short_factor), "long_factor": list(self.long_factor)}
            out["original_max_position_embeddings"] = self.original_context
        return out

    # ---- GGUF metadata ----

    @classmethod
    def from_gguf(
        cls,
        meta: Mapping[str, Any],
        context: int,
        divisors: np.ndarray | None,
        source: str,
        arch: str = "llama",
        factors: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> RopeScaling:
        """The scaling of a GGUF's `{arch}.rope.scaling.*` keys and its `rope_freqs.weight` tensor (divisors), or
        with factors (its `rope_factors_short` and `_long` tensors, as llama.cpp's converter writes Phi-3's
        longrope), longrope's, its original context and attention factor from the keys it writes beside them."""
        p = f"{arch}.rope.scaling."
        if factors is not None:
            read = _Reader({k.removeprefix(p): v for k, v in meta.items()}, source, "longrope")
            original = read.integer("original_context_length")
            try:
                return cls(
                    "longrope",
                    factor=context / original,
                    original_context=original,
                    attention_factor=read.number("attn_factor", 1.0),
                    short_factor=tuple(float(f) for f in np.asarray(factors[0], np.float32).reshape(-1)),
                    long_factor=tuple(float(f) for f in np.asarray(factors[1], np.float32).reshape(-1)),
                )
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from e
        kind = meta.get(p + "type", "none")
        kind = "default" if kind in ("none", None) else kind
        if kind not in ("default", "linear", "yarn"):
            raise ConfigError(
                f"{source}: RoPE scaling {kind!r} ({p}type) is not supported; llama-jax runs none,"
                " linear and yarn, and a rope_freqs tensor"
            )
        for key, neutral in _GGUF_NEUTRAL.items():
            value = meta.get(p + key, neutral)
            if value != neutral:
                raise ConfigError(
                    f"{source}: {p}{key} is {value!r}; llama-jax runs YaRN as llama.cpp does by"
                    f" default ({key} {neutral}) only"
                )
        read = _Reader({k.removeprefix(p): v for k, v in meta.items()}, source, kind)
        fields: dict[str, Any] = {}
        if kind != "default":
            fields["factor"] = read.number("factor")
        if kind == "yarn":
            factor = fields["factor"]
            fields |= {
                "original_context": read.integer("original_context_length", context),
                "beta_fast": read.number("yarn_beta_fast", 32.0),
                "beta_slow": read.number("yarn_beta_slow", 1.0),
                "attention_factor": _mscale(factor),  # llama.cpp: 1 + 0.1·ln(factor), as transformers' default
            }
        if divisors is not None:
            fields["divisors"] = tuple(float(d) for d in np.asarray(divisors, np.float32).reshape(-1))
        try:
            return cls(kind, **fields)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from e


DEFAULT_ROPE = RopeScaling()  # no scaling (the config's default)

# the rope_scaling fields some kind of scaling computes with (transformers' required and optional keys of every
# rope_type); found under a kind that does not read them, they are refused
_COMPUTING = {
    "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor", "attention_factor", "mscale",
    "mscale_all_dim", "beta_fast", "beta_slow", "truncate", "short_factor", "long_factor",
}  # fmt: skip

# the GGUF YaRN keys llama-jax reads only at llama.cpp's defaults for a Llama model
_GGUF_NEUTRAL = {"attn_factor": 1.0, "yarn_log_multiplier": 0.0, "yarn_ext_factor": -1.0, "yarn_attn_factor": 1.0}


def _mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention factor for a context stretched `scale` times (the paper's 0.1·ln(s) + 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope_fields(read: _Reader, context: int, original: int | None) -> dict[str, Any]:
    """longrope's fields as transformers resolves them: factor defaults to context / original context, the
    attention factor to sqrt(1 + ln(factor) / ln(original context)) (1 for a factor of at most 1)."""
    original = read.integer("original_max_position_embeddings") if original is None else original
    factor = read.number("factor", None)
    factor = context / original if factor is None else factor
    attention = read.number("attention_factor", None)
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1.0 else 1.0
    return {
        "factor": factor,
        "original_context": original,
        "attention_factor": float(attention),
        "short_factor": read.numbers("short_factor"),
        "long_factor": read.numbers("long_factor"),
    }


def _yarn_fields(read: _Reader, context: int) -> dict[str, Any]:
    """yarn's fields as transformers resolves them: factor defaults to context / original context, the attention
    factor to mscale(factor) (or the ratio of two mscales when mscale and mscale_all_dim are both given)."""
    original = read.integer("original_max_position_embeddings", context)
    factor = read.number("factor", None)
    factor = context / original if factor is None else factor
    attention = read.number("attention_factor", None)
    if attention is None:
        mscale, mscale_all = read.number("mscale", None), read.number("mscale_all_dim", None)
        attention = _mscale(factor, mscale) / _mscale(factor, mscale_all) if mscale and mscale_all else _mscale(factor)
    return {
        "factor": factor,
        "original_context": original,
        "attention_factor": float(attention),
        "beta_fast": read.number("beta_fast", None) or 32.0,
        "beta_slow": read.number("beta_slow", None) or 1.0,
        "truncate": bool(read.data.get("truncate", True)),
    }


_REQUIRED = object()


class _Reader:
    """Typed reads of a RoPE scaling's fields: a missing or mistyped one is a ConfigError naming it."""

    def __init__(self, data: Mapping[str, Any], source: str, kind: str):
        self.data, self.source, self.kind = data, source, kind

    def _get(self, key: str, default: Any) -> Any:
        value = self.data.get(key, default)
        if value is _REQUIRED:
            raise ConfigError(f"{self.source}: RoPE scaling {self.kind!r} needs the field {key!r}")
        return value

    def number(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if value is not None and not (number and math.isfinite(value)):
            raise ConfigError(f"{self.source}: RoPE scaling field {key!r} is {value!r}; expected a finite number")
        return value if value is None else float(value)

    def numbers(self, key: str) -> tuple[float, ...]:
        value = self._get(key, _REQUIRED)
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in value)
        ):
            raise ConfigError(f"{self.source}: RoPE scaling field {key!r} is {value!r:.60}; expected a list of numbers")
        return tuple(float(x) for x in value)

    def integer(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self.source}: RoPE scaling field {key!r} is {value!r}; expected an integer")
        return value
