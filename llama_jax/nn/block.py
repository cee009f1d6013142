"""One decoder layer, in the spec's order (`block` in main.bend), with every intermediate kept as an `Act`.

The layer is cut where the keys and values leave it: `attention_inputs` computes n1, q, k, v and the rotated qr,
kr; the caller decides what the queries attend to (the block's own keys, or a cache they were just written into);
`attention_and_mlp` computes the rest, given how to attend. Residuals and norms are f32.

Edits (research): each activation, as it is computed, can get an intervention added (`Edits.add`) and chosen
positions replaced (`Edits.patch`); what comes after in the layer sees the edited value. A site without an edit
(a None field) compiles to nothing. Which sites a pass returns is its `keep` (`kept_sites`): a site not kept
costs no memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from llama_jax.core.config import LlamaConfig
from llama_jax.core.weights import LayerWeights
from llama_jax.errors import InvalidArgumentError
from llama_jax.nn.attention import Attend
from llama_jax.nn.linear import Project, projection
from llama_jax.nn.mlp import mlp
from llama_jax.nn.norm import rms_norm
from llama_jax.nn.rope import apply_rope


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Act:
    """What a layer computes at each position, in the order it computes them: the spec's Act (n1 q k v qr kr attn a
    n2 m y) and the research sites (qn, kn where the config has head_norms; pattern, mid, hidden). Each [..., T,
    width], the pattern [..., N, T, S]; with a leading layers axis when stacked by the layer scan.

    n1: the input norm (after its gain); q, k, v: the projections (widths qw, kvw, kvw; each plus its bias where
    the config has one); qn, kn: q and k with each head normed (Qwen3's q_norm, k_norm, after their gains; None for
    a model without them); qr, kr: q and k (qn and kn where normed) after RoPE (as they were in a layer without
    it); pattern: the attention probabilities, query head n at position t over the slots s (0 where masked);
    attn: the heads' attention outputs joined (qw); a: attn through the output projection; mid: the residual
    stream after attention (x + a, the second norm's input); n2: that norm (after its gain); hidden: the MLP's
    hidden activation silu(gate) · up (width ffn, the neuron basis); m: the MLP's output; y: the layer's output
    (the residual stream, mid + m).
    """

    n1: Float[Array, "*B T D"]
    q: Float[Array, "*B T M"]
    k: Float[Array, "*B T C"]
    v: Float[Array, "*B T C"]
    qn: Float[Array, "*B T M"] | None
    kn: Float[Array, "*B T C"] | None
    qr: Float[Array, "*B T M"]
    kr: Float[Array, "*B T C"]
    pattern: Float[Array, "*B N T S"]
    attn: Float[Array, "*B T M"]
    a: Float[Array, "*B T D"]
    mid: Float[Array, "*B T D"]
    n2: Float[Array, "*B T D"]
    hidden: Float[Array, "*B T F"]
    m: Float[Array, "*B T D"]
    y: Float[Array, "*B T D"]


ACT_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Act))
HEAD_NORM_SITES = ("qn", "kn")  # the sites only a model with per-head norms has


def model_sites(config: LlamaConfig) -> tuple[str, ...]:
    """The sites a model of this config computes: every one of ACT_NAMES, the per-head norms' only with them."""
    return tuple(n for n in ACT_NAMES if config.head_norms or n not in HEAD_NORM_SITES)


def act_shape(name: str, config: LlamaConfig, batch: int, length: int) -> tuple[int, ...]:
    """A site's shape for B sequences of T positions attending to their own T positions (as `forward` does):
    [B, T, width] (dim; qw for q, qr and attn; kvw for k, v and kr; ffn for hidden), the pattern [B, heads, T, T]."""
    if name == "pattern":
        return (batch, config.heads, length, length)
    width = {"q": config.qw, "qn": config.qw, "qr": config.qw, "attn": config.qw}
    width |= {"k": config.kvw, "kn": config.kvw, "v": config.kvw, "kr": config.kvw}
    width = (width | {"hidden": config.ffn}).get(name, config.dim)
    return (batch, length, width)


def kept_sites(keep: bool | str | Sequence[str] | None, config: LlamaConfig) -> tuple[str, ...]:
    """The sites a pass returns: every site the model computes for True (`model_sites`), none for False or None,
    else the names given (a name or a sequence of names, checked), in ACT_NAMES order. (`forward` returns the
    embeddings, the final norm and the logits with any kept site.)"""
    if keep is True:
        return model_sites(config)
    if keep is False or keep is None:
        return ()
    return site_names(keep, f"keep={keep!r} (True, False or names)", config)


def site_names(names: str | Iterable[str], what: str, config: LlamaConfig | None = None) -> tuple[str, ...]:
    """Names of `Act`'s sites, each checked (InvalidArgumentError naming the unknown ones; with a config, the sites
    its model lacks: qn, kn without head_norms), in the Act's order: the one check of a site's name (kept sites,
    edits, patching). what: the argument, as the message's start."""
    names = (names,) if isinstance(names, str) else tuple(names)
    unknown = [name for name in names if name not in ACT_NAMES]
    if unknown:
        raise InvalidArgumentError(f"{what}: no activation named {unknown}; the site names are {', '.join(ACT_NAMES)}")
    lacking = [name for name in names if config is not None and name not in model_sites(config)]
    if lacking:
        raise InvalidArgumentError(
            f"{what}: {lacking} are the queries' and keys' per-head norms, which this {config.family} model does not"
            " have (its config has no head_norms: Qwen3's do); its queries and keys are q and k"
        )
    return tuple(name for name in ACT_NAMES if name in names)


def only(act: Act, names: Sequence[str]) -> Act:
    """act with only the named sites (the others None: no leaves, no memory)."""
    return Act(**{name: getattr(act, name) if name in names else None for name in ACT_NAMES})


def sparse_act(**fields: Array) -> Act:
    """An Act with only the given fields (the others None: no leaves in the pytree), for edits."""
    site_names(fields, "an edit")
    return Act(**{name: fields.get(name) for name in ACT_NAMES})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Patch:
    """Replaces activations: where mask is true, the value from values. Each field of values has its site's shape
    ([..., T, width]; the pattern [..., N, T, S]) and of mask [..., T] (the query positions; with a leading layers
    axis for a whole model), or None for a site left alone."""

    values: Act
    mask: Act


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Edits:
    """What to change in a layer's activations: add (an Act of additive interventions) and patch."""

    add: Act | None = None
    patch: Patch | None = None


def _edited(edits: Edits | None, name: str, value: Float[Array, "B T Y"]) -> Float[Array, "B T Y"]:
    """value with its site's intervention added and its patched positions replaced (the pattern [B, N, T, S]:
    its query positions T)."""
    if edits is None:
        return value
    if edits.add is not None and getattr(edits.add, name) is not None:
        value = value + getattr(edits.add, name).astype(value.dtype)  # [B, T, W]
    if edits.patch is not None and getattr(edits.patch.values, name) is not None:
        mask = getattr(edits.patch.mask, name)  # [B, T]
        mask = mask[:, None, :, None] if name == "pattern" else mask[..., None]  # [B, 1, T, 1] or [B, T, 1]
        value = jnp.where(mask, getattr(edits.patch.values, name).astype(value.dtype), value)  # [B, T, W]
    return value


def _edit_of(edits: Edits | None, name: str) -> Callable[[Array], Array] | None:
    """The edit of a site computed inside another function (the pattern, the MLP's hidden), None without one."""
    if edits is None:
        return None
    touched = [part for part in (edits.add, edits.patch and edits.patch.values) if part is not None]
    if all(getattr(part, name) is None for part in touched):
        return None
    return lambda value: _edited(edits, name, value)


def _residual(out: Float[Array, "B T D"], config: LlamaConfig) -> Float[Array, "B T D"]:
    """An output as it joins the residual stream: times the config's residual_multiplier (1: unchanged)."""
    multiplier = config.residual_multiplier
    return out if multiplier == 1.0 else out * jnp.asarray(multiplier, out.dtype)


@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """The first half of a layer: the norm, the projections, and the rotated queries and keys (heads split)."""

    n1: Float[Array, "B T D"]
    q: Float[Array, "B T M"]
    k: Float[Array, "B T C"]
    v: Float[Array, "B T C"]
    qn: Float[Array, "B T M"] | None
    kn: Float[Array, "B T C"] | None
    qr: Float[Array, "B T N H"]
    kr: Float[Array, "B T K H"]


def attention_inputs(
    lw: LayerWeights,
    x: Float[Array, "B T D"],
    cos: Float[Array, "B T P"],
    sin: Float[Array, "B T P"],
    config: LlamaConfig,
    edits: Edits | None = None,
    project: Project | None = None,
    rope: Bool[Array, ""] | None = None,
) -> AttentionInputs:
    """n1 = rmsnorm(x); q, k, v = its projections (each plus its bias where the config has one); qr, kr = q and k
    rotated, heads split ([B, T, heads, H]): each head first normed where the config has head_norms (Qwen3's
    q_norm, k_norm, over the head's H numbers), and rotated only where `rope` (this layer takes RoPE: the config's
    `rope_layers`, traced in the layer scan; None: it does)."""
    b, t, _ = x.shape
    project = project or projection(lw, precision=config.precision)
    n1 = _edited(edits, "n1", rms_norm(x, lw.ln1, config.eps))  # [B, T, D]
    q, k, v = project(n1, ("q", "k", "v"))  # [B, T, M], [B, T, C], [B, T, C]
    q, k, v = _edited(edits, "q", q), _edited(edits, "k", k), _edited(edits, "v", v)
    qh, kh = q.reshape(b, t, config.heads, config.head_dim), k.reshape(b, t, config.kv, config.head_dim)
    qn = kn = None
    if config.head_norms:
        qn = _edited(edits, "qn", rms_norm(qh, lw.q_norm, config.eps).reshape(b, t, config.qw))  # [B, T, M]
        kn = _edited(edits, "kn", rms_norm(kh, lw.k_norm, config.eps).reshape(b, t, config.kvw))  # [B, T, C]
        qh, kh = qn.reshape(qh.shape), kn.reshape(kh.shape)  # [B, T, N, H], [B, T, K, H]
    elif any(_edit_of(edits, name) is not None for name in HEAD_NORM_SITES):
        site_names(HEAD_NORM_SITES, "an edit", config)  # raises: this model has no such site
    qr, kr = apply_rope(qh, cos, sin), apply_rope(kh, cos, sin)  # [B, T, N, H], [B, T, K, H]
    if rope is not None:  # a layer without RoPE keeps the heads as they are
        qr, kr = jnp.where(rope, qr, qh), jnp.where(rope, kr, kh)
    qr = _edited(edits, "qr", qr.reshape(b, t, config.qw)).reshape(qr.shape)  # [B, T, N, H]
    kr = _edited(edits, "kr", kr.reshape(b, t, config.kvw)).reshape(kr.shape)  # [B, T, K, H]
    return AttentionInputs(n1, q, k, v, qn, kn, qr, kr)


def attention_and_mlp(
    lw: LayerWeights,
    x: Float[Array, "B T D"],
    inputs: AttentionInputs,
    attend: Attend,
    config: LlamaConfig,
    edits: Edits | None = None,
    project: Project | None = None,
) -> Act:
    """The rest of the layer: attention (attend, over the keys and values the caller chose), output projection,
    residual, MLP. Where the config has a residual_multiplier (Granite's), attention's and the MLP's outputs (a
    and m, as the sites hold them) are multiplied by it as they join the residual stream."""
    b, t, _ = x.shape
    project = project or projection(lw, precision=config.precision)
    heads, pattern = attend(inputs.qr, _edit_of(edits, "pattern"))  # [B, T, N, H], [B, N, T, S]
    attn = _edited(edits, "attn", heads.reshape(b, t, config.qw))  # [B, T, M]
    a = _edited(edits, "a", project(attn, ("o",))[0])  # [B, T, D]
    mid = _edited(edits, "mid", x + _residual(a, config))  # [B, T, D]
    n2 = _edited(edits, "n2", rms_norm(mid, lw.ln2, config.eps))  # [B, T, D]
    m, hidden = mlp(n2, project, _edit_of(edits, "hidden"))  # [B, T, D], [B, T, F]
    m = _edited(edits, "m", m)  # [B, T, D]
    y = _edited(edits, "y", mid + _residual(m, config))  # [B, T, D]
    return Act(
        n1=inputs.n1,
        q=inputs.q,
        k=inputs.k,
        v=inputs.v,
        qn=inputs.qn,
        kn=inputs.kn,
        qr=inputs.qr.reshape(b, t, config.qw),
        kr=inputs.kr.reshape(b, t, config.kvw),
        pattern=pattern,
        attn=attn,
        a=a,
        mid=mid,
        n2=n2,
        hidden=hidden,
        m=m,
        y=y,
    )
