"""Activation patching and its first-order estimate, attribution patching (AtP), over pairs of prompts.

For a pair (clean, corrupt) of token sequences of one length, a metric of the logits, and a site: the effect of
patching the site at layer l and position t is metric(corrupt run with that activation replaced by the clean
run's) − metric(corrupt run). `activation_patching` computes every such effect exactly, one patched forward pass
each (batched: one row a patch, jitted); `attribution_patching` estimates them all at once from one forward and
one backward pass of the corrupt run and one forward pass of the clean one: ∇_site metric(corrupt) ·
(clean − corrupt), summed over the site's width (the pattern: over its heads and keys, a patch replacing a query
position's row in every head, as `Patch` does). The estimate is exact where the metric is linear in the site.

metric(logits [T, V], target [K]) → a scalar, with target a pair's own ints (e.g. the ids of the right and the
wrong answer); it must be a JAX function, hashable (a module-level function: each new function compiles again).
Pairs run in groups of one length, batch_size pairs (or patches) a pass.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from llama_jax.core.config import LlamaConfig
from llama_jax.core.quantized import compute_dtype
from llama_jax.core.weights import Weights
from llama_jax.errors import InvalidArgumentError
from llama_jax.model import Model
from llama_jax.nn.block import ACT_NAMES, Patch, site_names, sparse_act
from llama_jax.passes.checks import check_count, check_ids, check_tokens, ids_of
from llama_jax.passes.forward import forward
from llama_jax.research.gradients import zero_interventions

Metric = Callable[[Float[Array, "T V"], Int[Array, " K"]], Float[Array, ""]]
SITES = ("y", "a", "m")  # the default sites: the residual stream, the attention and the MLP outputs


def _effect_sum(name: str, value: Float[Array, "L B ..."]) -> Float[Array, "L B T"]:
    """A site's per-element products summed to one number a layer and position (the pattern [L, B, N, T, S]: over
    its heads and keys)."""
    return value.sum(axis=(2, 4)) if name == "pattern" else value.sum(-1)


@functools.partial(jax.jit, static_argnames=("config", "metric", "sites", "native"))
def attribution_of(
    weights: Weights,
    clean: Int[Array, "P T"],
    corrupt: Int[Array, "P T"],
    targets: Int[Array, "P K"],
    config: LlamaConfig,
    metric: Metric,
    sites: tuple[str, ...],
    native: bool = False,
) -> tuple[dict[str, Float[Array, "P L T"]], Float[Array, " P"], Float[Array, " P"]]:
    """The functional core of `attribution_patching` for P pairs of one length: each site's estimates [P, L, T],
    and the metric of the clean and of the corrupt runs [P] (config, metric, sites, native static)."""
    _, t = clean.shape

    def one(clean, corrupt, target):  # [T], [T], [K]
        clean_logits, clean_acts = forward(weights, clean[None], config, keep=sites, native=native)

        def corrupt_metric(add):
            logits, acts = forward(weights, corrupt[None], config, keep=sites, add=add, native=native)
            return metric(logits[0], target), acts

        zeros = zero_interventions(config, 1, t, compute_dtype(weights.emb), sites)
        (value, corrupt_acts), grads = jax.value_and_grad(corrupt_metric, has_aux=True)(zeros)
        estimates = {}
        for name in sites:
            clean_site, corrupt_site = (
                getattr(acts.layers, name).astype(jnp.float32) for acts in (clean_acts, corrupt_acts)
            )
            product = getattr(grads, name).astype(jnp.float32) * (clean_site - corrupt_site)  # [L, 1, T, W], f32
            estimates[name] = _effect_sum(name, product)[:, 0]  # [L, T]
        return estimates, metric(clean_logits[0], target), value

    return jax.vmap(one)(clean, corrupt, targets)


@functools.partial(jax.jit, static_argnames=("config", "metric", "site", "native"))
def patched_metrics(
    weights: Weights,
    corrupt: Int[Array, " T"],
    clean_site: Float[Array, "L 1 ..."],
    target: Int[Array, " K"],
    layers: Int[Array, " R"],
    positions: Int[Array, " R"],
    config: LlamaConfig,
    metric: Metric,
    site: str,
    native: bool = False,
) -> Float[Array, " R"]:
    """The metric of R runs of the corrupt sequence, run r with the site at (layers[r], positions[r]) replaced by
    the clean run's value there (config, metric, site, native static)."""
    (t,), r = corrupt.shape, layers.shape[0]
    mask = (jnp.arange(config.layers)[:, None, None] == layers[None, :, None]) & (
        jnp.arange(t)[None, None, :] == positions[None, :, None]
    )  # [L, R, T]: one patched position a row
    patch = Patch(sparse_act(**{site: clean_site}), sparse_act(**{site: mask}))
    logits, _ = forward(weights, jnp.broadcast_to(corrupt, (r, t)), config, patch=patch, native=native)  # [R, T, V]
    return jax.vmap(metric, in_axes=(0, None))(logits, target)  # [R]


def _pairs(model: Model, clean, corrupt, targets) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The pairs as ids (texts encoded), checked: the same length within a pair, inside the vocabulary and the
    context, one target array (of one length for all) a pair."""
    if not (len(clean) == len(corrupt) == len(targets)) or not clean:
        raise InvalidArgumentError(
            f"clean, corrupt and targets must be lists of one non-zero length, got {len(clean)}, {len(corrupt)} and"
            f" {len(targets)}"
        )
    pairs = []
    for i, (a, b, target) in enumerate(zip(clean, corrupt, targets, strict=True)):
        where, fix = f"pair {i}: ", "give shorter prompts"
        a, b = (check_ids(ids_of(x, model.tokenizer.encode, where), model.config, where, fix) for x in (a, b))
        if a.size != b.size:
            raise InvalidArgumentError(
                f"pair {i}: clean has {a.size} tokens and corrupt {b.size}; patching needs the same positions in"
                " both (pad or reword one)"
            )
        target = np.atleast_1d(np.asarray(target))
        if not np.issubdtype(target.dtype, np.integer) or target.ndim != 1:
            raise InvalidArgumentError(f"pair {i}: its target must be an int or a list of ints, got {target!r:.60}")
        check_tokens(target, model.config.vocab, where)  # metrics index the logits with them
        pairs.append((a, b, target.astype(np.int32)))
    if len({p[2].shape for p in pairs}) != 1:
        raise InvalidArgumentError("every pair's target must have the same length (e.g. [right id, wrong id])")
    return pairs


def _sites(sites: Sequence[str], config: LlamaConfig) -> tuple[str, ...]:
    names = site_names(sites, "sites", config)
    if not names:
        raise InvalidArgumentError(f"sites={sites!r}: give at least one site name among {', '.join(ACT_NAMES)}")
    return names


def _groups(pairs, batch_size: int):
    """Indices of the pairs in groups of one length, batch_size at most."""
    by_length: dict[int, list[int]] = {}
    for i, (a, _, _) in enumerate(pairs):
        by_length.setdefault(a.size, []).append(i)
    for indices in by_length.values():
        for start in range(0, len(indices), batch_size):
            yield indices[start : start + batch_size]


def attribution_patching(
    model: Model,
    clean: Sequence[str | Sequence[int]],
    corrupt: Sequence[str | Sequence[int]],
    metric: Metric,
    targets: Sequence[Sequence[int] | int],
    sites: Sequence[str] = SITES,
    batch_size: int = 8,
) -> dict[str, list[np.ndarray]]:
    """The AtP estimate of every patch's effect: for each site (names of `Act`, the pattern included), a list
    over the pairs of [layers, T] arrays; also "clean" and "corrupt", each pair's metric of the two runs (lists of
    floats). clean and corrupt: texts or ids, pair by pair of one token length; targets: each pair's ints for the
    metric."""
    check_count(batch_size, "batch_size")
    pairs, names = _pairs(model, clean, corrupt, targets), _sites(sites, model.config)
    out: dict[str, list] = {name: [None] * len(pairs) for name in (*names, "clean", "corrupt")}
    for group in _groups(pairs, batch_size):
        rows = group + [group[0]] * (batch_size - len(group))  # one shape a length: the last group padded
        a, b, t = (jnp.asarray(np.stack([pairs[i][k] for i in rows])) for k in range(3))
        estimates, clean_value, corrupt_value = attribution_of(
            model.weights, a, b, t, model.config, metric, names, model.native.active
        )
        host = {name: np.asarray(v) for name, v in estimates.items()}
        for row, i in enumerate(group):
            for name in names:
                out[name][i] = host[name][row]
            out["clean"][i], out["corrupt"][i] = float(clean_value[row]), float(corrupt_value[row])
    return out


def activation_patching(
    model: Model,
    clean: Sequence[str | Sequence[int]],
    corrupt: Sequence[str | Sequence[int]],
    metric: Metric,
    targets: Sequence[Sequence[int] | int],
    sites: Sequence[str] = SITES,
    batch_size: int = 8,
) -> dict[str, list[np.ndarray]]:
    """The exact effect of every patch, as `attribution_patching` lays its estimates out: for each site and pair,
    [layers, T] of metric(corrupt run, the site at (layer, position) from the clean run) − metric(corrupt run),
    batch_size patched runs a pass; "clean" and "corrupt" as there."""
    check_count(batch_size, "batch_size")
    pairs, names = _pairs(model, clean, corrupt, targets), _sites(sites, model.config)
    c = model.config
    out: dict[str, list] = {name: [] for name in (*names, "clean", "corrupt")}
    native = model.native.active
    for a, b, target in pairs:
        clean_logits, clean_acts = _forward_kept(model, a, names)
        logits = _forward_kept(model, b, ())[0]
        base = float(metric(logits[0], jnp.asarray(target)))
        out["clean"].append(float(metric(clean_logits[0], jnp.asarray(target))))
        out["corrupt"].append(base)
        grid = np.stack(np.meshgrid(np.arange(c.layers), np.arange(a.size), indexing="ij"), -1).reshape(-1, 2)
        for name in names:
            values = np.empty(len(grid), np.float32)
            site = getattr(clean_acts.layers, name)  # [L, 1, T, W] (the pattern [L, 1, N, T, T])
            for start in range(0, len(grid), batch_size):
                chunk = grid[start : start + batch_size]
                padded = np.concatenate([chunk, np.repeat(chunk[:1], batch_size - len(chunk), 0)])  # [R, 2]
                metrics = patched_metrics(
                    model.weights, jnp.asarray(b), site, jnp.asarray(target), jnp.asarray(padded[:, 0]),
                    jnp.asarray(padded[:, 1]), c, metric, name, native,
                )  # fmt: skip
                values[start : start + len(chunk)] = np.asarray(metrics)[: len(chunk)] - base
            out[name].append(values.reshape(c.layers, a.size))
    return out


def _forward_kept(model: Model, ids: np.ndarray, keep: tuple[str, ...]):
    return _jit_forward(model.weights, jnp.asarray(ids[None]), model.config, keep=keep, native=model.native.active)


_jit_forward = jax.jit(forward, static_argnames=("config", "keep", "native"))
