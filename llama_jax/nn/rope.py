"""RoPE (LlamaRotaryEmbedding): number i of a head's first half rotates with number i of its second half.

inv_freq[i] = 1 / theta^(2i / head) (scaled by the config's `RopeScaling`, see core/rope_scaling.py), the angle of
position p is p·inv_freq[i], and a head x = (lo, hi) becomes (lo·cos - hi·sin, hi·cos + lo·sin), which is
transformers' x·cos + rotate_half(x)·sin written per half; YaRN and LongRoPE scale cos and sin by their attention
factor.
Each frequency is computed in f32 in transformers' order of operations (`modeling_rope_utils.py`).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from llama_jax.core.config import LlamaConfig

_f32 = np.float32


def _exponents(config: LlamaConfig) -> np.ndarray:
    return np.arange(0, config.head_dim, 2, dtype=np.int64).astype(_f32) / _f32(config.head_dim)  # [half]: 2i / head


def _powers(theta: float, config: LlamaConfig) -> np.ndarray:
    """theta^(2i / head) in f32, correctly rounded: what torch's f32 pow gives. numpy's f32 power is not (with
    AVX-512 it takes SVML's, off by an ulp in about one value of four), so it is taken in f64 and rounded once."""
    return (np.float64(_f32(theta)) ** _exponents(config).astype(np.float64)).astype(_f32)  # [half]


def _default(config: LlamaConfig, theta: float) -> np.ndarray:
    return (_f32(1.0) / _powers(theta, config)).astype(_f32)  # [half]


def _llama3(config: LlamaConfig) -> np.ndarray:
    """Llama 3.1: wavelengths longer than original/low_freq_factor divided by factor, shorter than
    original/high_freq_factor kept, a linear blend in 1/wavelength between."""
    r = config.rope
    inv = _default(config, config.theta)  # [half]
    wavelen = _f32(2 * math.pi) / inv
    low_wavelen, high_wavelen = r.original_context / r.low_freq_factor, r.original_context / r.high_freq_factor
    scaled = np.where(wavelen > _f32(low_wavelen), inv / _f32(r.factor), inv)
    smooth = (_f32(r.original_context) / wavelen - _f32(r.low_freq_factor)) / _f32(
        r.high_freq_factor - r.low_freq_factor
    )
    smoothed = (_f32(1) - smooth) * scaled / _f32(r.factor) + smooth * scaled
    medium = ~(wavelen < _f32(high_wavelen)) & ~(wavelen > _f32(low_wavelen))
    return np.where(medium, smoothed, scaled).astype(_f32)


def _yarn(config: LlamaConfig) -> np.ndarray:
    """YaRN: interpolated (/ factor) frequencies below the ramp of dimensions [low, high], kept ones above."""
    r, head, theta = config.rope, config.head_dim, float(config.theta)

    def dimension(rotations: float) -> float:  # the dimension that turns `rotations` times in the original context
        return head * math.log(r.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(r.beta_fast), dimension(r.beta_slow)
    if r.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = _powers(theta, config)  # [half]
    extrapolated, interpolated = _f32(1) / pos_freqs, _f32(1) / (_f32(r.factor) * pos_freqs)
    ramp = np.clip((np.arange(config.half, dtype=_f32) - _f32(low)) / _f32(high - low), 0, 1)
    kept = _f32(1) - ramp  # [half]: 1 where a frequency extrapolates (is kept)
    return (interpolated * (_f32(1) - kept) + extrapolated * kept).astype(_f32)


def _longrope(config: LlamaConfig, long: bool) -> np.ndarray:
    """LongRoPE: 1 / (ext · theta^(2i/head)), ext the long factors or the short ones, in transformers' order."""
    r = config.rope
    ext = np.asarray(r.long_factor if long else r.short_factor, _f32)  # [half]
    return (_f32(1.0) / (ext * _powers(config.theta, config))).astype(_f32)


def _dynamic_theta(config: LlamaConfig) -> float:
    """Dynamic NTK's base at the trained context, the longest sequence the context check lets in (past it the base
    would grow with the sequence): theta·(factor·n/context - (factor-1))^(head/(head-2)) at n = context, in
    transformers' arithmetic (so 1.0, and the default's frequencies, whenever that rounds to 1)."""
    r = config.rope
    stretch = r.factor * config.context / config.context - (r.factor - 1)
    return config.theta if stretch == 1.0 else config.theta * stretch ** (config.head_dim / (config.head_dim - 2))


def inv_freq(config: LlamaConfig, long: bool = False) -> np.ndarray:
    """The half frequencies of every position, in f32 as transformers computes them (llama.cpp's divisors last);
    long: longrope's long factors (past the original context) instead of its short ones."""
    r = config.rope
    if r.kind == "longrope":
        inv = _longrope(config, long)
    elif r.kind == "linear":
        inv = (_default(config, config.theta) / _f32(r.factor)).astype(_f32)
    elif r.kind == "dynamic":
        inv = _default(config, _dynamic_theta(config))
    elif r.kind == "llama3":
        inv = _llama3(config)
    elif r.kind == "yarn":
        inv = _yarn(config)
    else:
        inv = _default(config, config.theta)
    if r.divisors:
        inv = (inv / np.asarray(r.divisors, _f32)).astype(_f32)
    return inv  # [half]


def rope_tables(
    positions: Int[Array, "B T"],
    config: LlamaConfig,
    dtype: jnp.dtype = jnp.float32,
    ends: Int[Array, " B"] | None = None,
) -> tuple[Float[Array, "B T P"], Float[Array, "B T P"]]:
    """cos and sin of every position's angles, shared by every head of every layer (the spec's Rot); dtype: the
    activations' (f32; f64 in gradient checks). ends: each sequence's length in this pass (its last real
    position + 1; default: its last position + 1), by which longrope takes its long factors for a sequence past
    the original context and its short ones up to it, as transformers' `longrope_frequency_update` does for a
    sequence alone (per sequence here, so a batch changes no sequence's bits)."""
    angles = positions.astype(dtype)[..., None] * jnp.asarray(inv_freq(config), dtype)  # [B, T, half]
    if config.rope.kind == "longrope":
        ends = positions[:, -1] + 1 if ends is None else ends  # [B]
        long = positions.astype(dtype)[..., None] * jnp.asarray(inv_freq(config, long=True), dtype)
        angles = jnp.where((ends > config.rope.original_context)[:, None, None], long, angles)  # [B, T, half]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if config.rope.kind in ("yarn", "longrope"):
        scale = jnp.asarray(config.rope.attention_factor, dtype)
        cos, sin = cos * scale, sin * scale  # [*B, T, half] each
    return cos, sin


def apply_rope(
    x: Float[Array, "B T E H"], cos: Float[Array, "B T P"], sin: Float[Array, "B T P"]
) -> Float[Array, "B T E H"]:
    """Rotates every head of x (n heads of H = 2·half numbers) by the angles of its position."""
    half = x.shape[-1] // 2
    lo, hi = x[..., :half], x[..., half:]  # [B, T, n, half] each
    c, s = cos[:, :, None, :], sin[:, :, None, :]  # [B, T, 1, half]
    return jnp.concatenate([lo * c + (-hi) * s, hi * c + lo * s], axis=-1)  # [B, T, n, H]
