"""The SwiGLU MLP: down(silu(gate(x)) * up(x)), silu(x) = x / (1 + exp(-x)) as ATen's CPU kernel computes it."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from llama_jax.nn.linear import linear


def silu(x: Float[Array, "*B"]) -> Float[Array, "*B"]:
    return x / (1.0 + jnp.exp(-x))


def mlp(
    x: Float[Array, "B T D"], gate: Float[Array, "F D"], up: Float[Array, "F D"], down: Float[Array, "D F"]
) -> Float[Array, "B T D"]:
    return linear(silu(linear(x, gate)) * linear(x, up), down)  # [B, T, F] -> [B, T, D]
