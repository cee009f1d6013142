"""TransformerLens' names for llama-jax's activations, and its `run_with_cache`, for code ported from it.

TransformerLens (classic `HookedTransformer`) names each hook point `blocks.{i}.<hook>`; `TRANSFORMER_LENS` maps
each hook to the `Act` site (or the input embeddings) that holds the same numbers, and how its axes are laid out:

| TransformerLens hook          | llama-jax site             | shape in the cache                     |
|-------------------------------|----------------------------|----------------------------------------|
| hook_embed                    | embeds                     | [batch, pos, d_model]                  |
| blocks.{i}.hook_resid_pre     | embeds (i = 0), else y[i-1]| [batch, pos, d_model]                  |
| blocks.{i}.attn.hook_q        | q                          | [batch, pos, head_index, d_head]       |
| blocks.{i}.attn.hook_k        | k                          | [batch, pos, kv_head_index, d_head]    |
| blocks.{i}.attn.hook_v        | v                          | [batch, pos, kv_head_index, d_head]    |
| blocks.{i}.attn.hook_rot_q    | qr                         | [batch, pos, head_index, d_head]       |
| blocks.{i}.attn.hook_rot_k    | kr                         | [batch, pos, kv_head_index, d_head]    |
| blocks.{i}.attn.hook_pattern  | pattern                    | [batch, head_index, query_pos, key_pos]|
| blocks.{i}.attn.hook_z        | attn                       | [batch, pos, head_index, d_head]       |
| blocks.{i}.hook_attn_out      | a                          | [batch, pos, d_model]                  |
| blocks.{i}.hook_resid_mid     | mid                        | [batch, pos, d_model]                  |
| blocks.{i}.mlp.hook_post      | hidden                     | [batch, pos, d_mlp]                    |
| blocks.{i}.hook_mlp_out       | m                          | [batch, pos, d_model]                  |
| blocks.{i}.hook_resid_post    | y                          | [batch, pos, d_model]                  |

Not mapped: TransformerLens' `ln1.hook_normalized`, `ln2.hook_normalized` and `ln_final.hook_normalized` are
the RMSNorm's output before its gain (with the gain folded into the next weights); llama-jax's n1, n2 and nf are
after it (transformers' order): divide by the norm's weight to compare. Qwen3's per-head norms (the sites qn, kn,
after their gains) have no hook name here: read them by their site names. Key/value heads are not repeated to the
query heads (TransformerLens' grouped-query attention hooks k and v per key/value head too): query head
j·G + i reads key/value head j.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import numpy as np

from llama_jax.core.config import LlamaConfig
from llama_jax.errors import InvalidArgumentError
from llama_jax.model import Model
from llama_jax.passes.checks import ids_of

# hook (after "blocks.{i}.") -> (site, heads axis to split: "heads", "kv" or None)
_BLOCK_HOOKS: dict[str, tuple[str, str | None]] = {
    "hook_resid_pre": ("resid_pre", None),
    "attn.hook_q": ("q", "heads"),
    "attn.hook_k": ("k", "kv"),
    "attn.hook_v": ("v", "kv"),
    "attn.hook_rot_q": ("qr", "heads"),
    "attn.hook_rot_k": ("kr", "kv"),
    "attn.hook_pattern": ("pattern", None),
    "attn.hook_z": ("attn", "heads"),
    "hook_attn_out": ("a", None),
    "hook_resid_mid": ("mid", None),
    "mlp.hook_post": ("hidden", None),
    "hook_mlp_out": ("m", None),
    "hook_resid_post": ("y", None),
}
TRANSFORMER_LENS: dict[str, str] = {"hook_embed": "embeds"} | {
    f"blocks.{{i}}.{hook}": s for hook, (s, _) in _BLOCK_HOOKS.items()
}

Names = str | Sequence[str] | Callable[[str], bool] | None


def hook_names(config: LlamaConfig) -> list[str]:
    """Every TransformerLens hook name a model of this config has a value for, layer by layer."""
    return ["hook_embed"] + [f"blocks.{i}.{hook}" for i in range(config.layers) for hook in _BLOCK_HOOKS]


def run_with_cache(
    model: Model, inputs: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]], names_filter: Names = None
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """TransformerLens' `run_with_cache`: the logits [batch, pos, vocab] and a dict hook name -> activations (shapes
    in the module's table) of one text or ids, or a batch of texts or ids of one token length. names_filter: the
    hooks to return, as TransformerLens takes it (None: all; a name; a list of names; a predicate of a name); only
    the sites they need are stored."""
    batch = _token_batch(model, inputs)
    wanted = _selected(model.config, names_filter)
    keep = sorted({hook_site(name)[0] for name in wanted} - {"embeds"})
    runs = [model.activations(ids, keep=tuple(keep)) for ids in batch]  # each sequence's numbers as in a batch
    stacked = {key: np.stack([run[key] for run in runs]) for key in runs[0]}  # [B, L, ...] and [B, T, ...]
    cache = {name: _value(name, stacked, model.config) for name in wanted}
    return stacked["logits"], cache


def _token_batch(model: Model, inputs) -> list[list[int]]:
    """The batch's sequences of ids (texts encoded), all of one length."""
    one = isinstance(inputs, str) or (len(inputs) > 0 and isinstance(inputs[0], (int, np.integer)))
    batch = [list(ids_of(x, model.tokenizer.encode)) for x in ([inputs] if one else inputs)]
    if not batch or len({len(ids) for ids in batch}) != 1:
        raise InvalidArgumentError(
            f"run_with_cache takes one text or ids, or a batch of them of one token length; got lengths"
            f" {[len(ids) for ids in batch]}: pad them yourself, or run them one at a time"
        )
    return batch


def _selected(config: LlamaConfig, names_filter: Names) -> list[str]:
    names = hook_names(config)
    if names_filter is None:
        return names
    if callable(names_filter):
        return [name for name in names if names_filter(name)]
    wanted = [names_filter] if isinstance(names_filter, str) else list(names_filter)
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        raise InvalidArgumentError(
            f"no TransformerLens hook named {unknown} in this model; the hooks are hook_embed and"
            f" blocks.{{0..{config.layers - 1}}}.{{{', '.join(_BLOCK_HOOKS)}}} (llama_jax.lens.hook_names)"
        )
    return wanted


def hook_site(name: str) -> tuple[str, int | None, str | None]:
    """Where a TransformerLens hook's numbers live in llama-jax: the site ("embeds", or an `Act` name), its layer
    (None for the embeddings) and the heads axis its last axis splits into ("heads", "kv" or None). blocks.{i}.
    hook_resid_pre is the embeddings at layer 0 and the previous layer's y after it. The name must be one of
    `hook_names` (checked by the callers against the config)."""
    if name == "hook_embed":
        return "embeds", None, None
    layer, hook = re.fullmatch(r"blocks\.(\d+)\.(.+)", name).groups()
    i = int(layer)
    site, heads = _BLOCK_HOOKS[hook]
    if site == "resid_pre":
        return ("embeds", None, None) if i == 0 else ("y", i - 1, None)
    return site, i, heads


def split_heads(value: np.ndarray, heads: str | None, config: LlamaConfig) -> np.ndarray:
    """A site's [..., width] values with the width split as a TransformerLens hook lays it out ([..., heads, H])."""
    if heads is None:
        return value
    n = config.heads if heads == "heads" else config.kv
    return value.reshape(*value.shape[:-1], n, config.head_dim)


def _value(name: str, stacked: dict[str, np.ndarray], config: LlamaConfig) -> np.ndarray:
    """One hook's activations [batch, ...] from the stacked sites ([B, L, T, width] each; embeds [B, T, D])."""
    site, layer, heads = hook_site(name)
    if layer is None:
        return stacked["embeds"]  # [B, T, D]
    value = stacked[site][:, layer]  # [B, T, width] or the pattern [B, N, T, T]
    return split_heads(value, heads, config)  # [B, T, heads, H] where the hook splits them
