"""The SwiGLU MLP: down(silu(gate(x)) * up(x)), silu(x) = x / (1 + exp(-x)) as ATen's CPU kernel computes it."""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from jaxtyping import Array, Float


def silu(x: Float[Array, "*B"]) -> Float[Array, "*B"]:
    return x / (1.0 + jnp.exp(-x))


def mlp(x: Float[Array, "B T D"], project: Callable[[Array, str], Array]) -> Float[Array, "B T D"]:
    """project(x, name): x times the named weight ("gate", "up", "down"), transposed."""
    return project(silu(project(x, "gate")) * project(x, "up"), "down")  # [B, T, F] -> [B, T, D]
