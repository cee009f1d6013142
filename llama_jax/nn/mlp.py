"""The SwiGLU MLP: down(silu(gate(x)) * up(x)), silu(x) = x / (1 + exp(-x)) as ATen's CPU kernel computes it."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jaxtyping import Array, Float

from llama_jax.nn.invariant import exp


def silu(x: Float[Array, "*B"]) -> Float[Array, "*B"]:
    return x / (1.0 + exp(-x))  # (`invariant.exp`: an element's bits do not depend on the array around it)


@jax.custom_jvp
def gated(gate: Float[Array, "*B"], up: Float[Array, "*B"]) -> Float[Array, "*B"]:
    """silu(gate) * up, the MLP's hidden activation. Its derivative is written out (ATen's silu_backward: σ · (1 +
    x · (1 - σ)), σ = 1 / (1 + e^-x)), so a gradient keeps two [*B] coefficients per layer, where autodiff through
    the division kept six intermediates (256 tokens of SmolLM2-135M: 4 x 47 MB of stacked residuals less)."""
    return silu(gate) * up


@gated.defjvp
def _gated_jvp(primals, tangents):
    gate, up = primals
    d_gate, d_up = tangents
    act = silu(gate)  # [*B]
    sigma = 1.0 / (1.0 + exp(-gate))  # [*B]
    return act * up, d_gate * (up * (sigma * (1.0 + gate * (1.0 - sigma)))) + d_up * act


def mlp(
    x: Float[Array, "B T D"],
    project: Callable[[Array, tuple[str, ...]], tuple[Array, ...]],
    edit: Callable[[Array], Array] | None = None,
) -> tuple[Float[Array, "B T D"], Float[Array, "B T F"]]:
    """The MLP's output and its hidden activation h = silu(gate(x)) * up(x) (the neuron basis), after `edit`
    (research: an intervention at h, which the down projection then sees). project(x, names): x times the named
    weights ("gate", "up", "down"), transposed, one product each (`block.Project`)."""
    gate, up = project(x, ("gate", "up"))  # [B, T, F] each
    hidden = gated(gate, up)  # [B, T, F]
    if edit is not None:
        hidden = edit(hidden)
    return project(hidden, ("down",))[0], hidden  # [B, T, D], [B, T, F]
