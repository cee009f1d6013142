"""The activation store on disk: what `collect` writes and `ActivationStore` reads back.

A store is a directory: `manifest.json` and shards `shard-00000.safetensors`, ... of `shard_rows` rows each (the
last may hold fewer). A row is one token position of one input; each shard holds, for every site, its rows
[R, *site's shape] (named by the site's key), and "input" and "position" [R] (int32): which input and which
position of it each row is. Rows follow the inputs' order, and within an input its positions' order.

The manifest is the store's truth: it names the shards written so far and where the run stands (the next row to
write), and identifies the run (the model's config, a digest of its weights as held, whether the native products
ran, the sites, the position rule, the dtype, a digest of the inputs covered so far); its layout gives each site's
source and row shape. Every file is written under a temporary name, flushed to disk and renamed (then the directory
flushed), the manifest last: a reader or a resumed run never sees a half-written file, and a shard written but not
yet in the manifest is written again.

Sites are named as llama-jax names them, "{site}.{layer}" ("y.6", "hidden.3"), a site alone for every layer
("y"), "embeds", "nf" and "logits"; or by TransformerLens hook names ("blocks.6.hook_resid_post", "hook_embed",
see `lens`), stored in the hook's layout ([R, heads, H] for hook_q, ...). The attention pattern is not a row of
a position (it is [heads, T, T] a sequence): store qr and kr, or attn, instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from llama_jax.core.config import LlamaConfig
from llama_jax.errors import ActivationStoreError, CheckpointError, InvalidArgumentError
from llama_jax.lens import hook_names, hook_site
from llama_jax.loaders.safetensors_file import DTYPES, SafetensorsFile
from llama_jax.nn.block import ACT_NAMES, act_shape, site_names
from llama_jax.passes.checks import check_count

FORMAT = "llama-jax activation store 1"
MANIFEST = "manifest.json"
STORE_DTYPES = {"float32": np.dtype("<f4"), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype("<f2")}
POSITION_RULES = ("all", "last", "mask")  # every real position, each input's last, a mask given with the inputs
INDEX_COLUMNS = ("input", "position")  # the int32 columns of every shard beside the sites
_SHARD_DTYPES = DTYPES | {"I32": np.dtype("<i4")}


@dataclasses.dataclass(frozen=True)
class Site:
    """One stored site: its key (the name asked for), where its numbers come from (source: an `Act` name,
    "embeds", "nf" or "logits"; layer: None for those three), and the shape of one row (heads split for a
    TransformerLens hook that splits them)."""

    key: str
    source: str
    layer: int | None
    shape: tuple[int, ...]


def parse_sites(names: str | Sequence[str], config: LlamaConfig) -> tuple[Site, ...]:
    """The sites a list of names asks for, in the order given (a site alone expands to every layer), each once."""
    names = [names] if isinstance(names, str) else list(names)
    if not names or not all(isinstance(n, str) for n in names):
        raise InvalidArgumentError(f"sites takes site names (e.g. 'y.6', 'blocks.6.hook_resid_post'), got {names!r}")
    sites: list[Site] = []
    for name in names:
        sites += _sites_of(name, config)
    keys = [s.key for s in sites]
    repeated = sorted({k for k in keys if keys.count(k) > 1})
    if repeated:
        raise InvalidArgumentError(f"sites {repeated} are asked for more than once; name each site once")
    return tuple(sites)


def _width(source: str, config: LlamaConfig) -> int:
    if source == "logits":
        return config.vocab
    return config.dim if source in ("embeds", "nf") else act_shape(source, config, 1, 1)[-1]


def _sites_of(name: str, config: LlamaConfig) -> list[Site]:
    if name in ("pattern", "hook_pattern") or name.startswith("pattern.") or name.endswith(".attn.hook_pattern"):
        raise InvalidArgumentError(
            f"site {name!r}: the attention pattern is [heads, T, T] a sequence, not a row of a position; store qr"
            " and kr (or attn) and recompute it, or read it per sequence with Model.activations"
        )
    if name in ("embeds", "nf", "logits"):
        return [Site(name, name, None, (_width(name, config),))]
    if name.partition(".")[0] in ACT_NAMES:
        site_names(name.partition(".")[0], f"site {name!r}", config)  # one the model computes
    if name in ACT_NAMES:
        return [Site(f"{name}.{i}", name, i, (_width(name, config),)) for i in range(config.layers)]
    source, _, layer = name.rpartition(".")
    if source in ACT_NAMES and layer.isdigit():
        if int(layer) >= config.layers:
            raise InvalidArgumentError(f"site {name!r}: layer {layer} of a model of {config.layers} layers (0..)")
        return [Site(name, source, int(layer), (_width(source, config),))]
    if name in hook_names(config):
        source, i, heads = hook_site(name)
        width = _width(source, config)
        n = {"heads": config.heads, "kv": config.kv}.get(heads)
        return [Site(name, source, i, (width,) if n is None else (n, config.head_dim))]
    raise InvalidArgumentError(
        f"no site named {name!r}: give '{{site}}.{{layer}}' with a site among {', '.join(ACT_NAMES[:6])}, ... (not"
        " the pattern), a site alone for every layer, embeds, nf, logits, or a TransformerLens hook name such as"
        " blocks.0.hook_resid_post (llama_jax.lens.hook_names)"
    )


def model_identity(config: LlamaConfig, weights, native: bool) -> dict:
    """What the stored numbers depend on besides the inputs: the config, a digest of every weight as held (its
    dtype and blocks included), and which products ran (the native ones agree with XLA's to f32 rounding only)."""
    digest = hashlib.blake2b(digest_size=16)
    for path, leaf in jax.tree_util.tree_leaves_with_path(weights):
        array = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)} {array.dtype} {array.shape}".encode())
        digest.update(np.ascontiguousarray(array).view(np.uint8).reshape(-1).data)
    config_json = json.loads(json.dumps(dataclasses.asdict(config)))  # as the manifest holds it (tuples as lists)
    if config.precision == "float32":  # the default tier: named only by the others, as stores made before tiers hold it
        del config_json["precision"]
    return {"config": config_json, "weights": digest.hexdigest(), "native": bool(native)}


def differences(stored: dict, asked: dict, prefix: str = "") -> list[str]:
    """The fields where two identities (nested dicts) differ, as 'name: store x, now y'."""
    out = []
    for key in sorted(set(stored) | set(asked)):
        a, b = stored.get(key), asked.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: store {a!r:.200}, now {b!r:.200}")
    return out


def write_atomically(path: Path, write) -> None:
    """write(temporary path) writes the file; then it is flushed to disk and renamed to path, and the directory
    flushed: a crash leaves the old file or the new one, never part of one."""
    temporary = path.with_name(path.name + ".tmp")
    write(temporary)
    fd = os.open(temporary, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(directory: Path, manifest: dict) -> None:
    write_atomically(directory / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=1), encoding="utf-8"))


def read_manifest(directory: Path) -> dict | None:
    """The store's manifest, None where the directory holds none; one that is not a store's is refused."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ActivationStoreError(f"{path}: not valid JSON ({e}); the store's manifest is corrupt") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ActivationStoreError(f"{path}: not an activation store's manifest (no format {FORMAT!r})")
    return manifest


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


class RowArray:
    """One site's rows over every shard, memory-mapped: len, shape, dtype, indexing by an int, a slice, an array of
    row indices or a boolean mask of the rows (→ a numpy array), and np.asarray (every row in memory)."""

    def __init__(self, parts: list[np.ndarray]):
        self._parts = parts
        self._starts = np.cumsum([0] + [len(p) for p in parts])  # [shards + 1]
        self.shape = (int(self._starts[-1]), *parts[0].shape[1:])
        self.dtype = parts[0].dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        if isinstance(index, (int, np.integer)):
            if not -len(self) <= index < len(self):
                raise IndexError(f"row {index} of a store of {len(self)} rows")
            return self.take(np.array([index % len(self)]))[0]
        if isinstance(index, slice):
            return self.take(np.arange(len(self))[index])
        index = np.asarray(index)
        if index.dtype == bool:  # a mask of the rows
            if index.shape != (len(self),):
                raise IndexError(f"a boolean mask of {index.shape} for {len(self)} rows")
            index = np.nonzero(index)[0]
        return self.take(index)

    def take(self, rows: np.ndarray) -> np.ndarray:
        """The rows at the given indices, in that order ([n, *shape])."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"rows {rows.min()}..{rows.max()} of a store of {len(self)} rows")
        out = np.empty((rows.size, *self.shape[1:]), self.dtype)
        shard = np.searchsorted(self._starts, rows, side="right") - 1  # [n]: the shard of each row
        for s in np.unique(shard):
            chosen = np.nonzero(shard == s)[0]
            out[chosen] = self._parts[s][rows[chosen] - self._starts[s]]
        return out

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate(self._parts) if self._parts else np.empty(self.shape, self.dtype)
        return whole if dtype is None else whole.astype(dtype)


class ActivationStore:
    """A store written by `collect`, read back: `sites` (key → Site), `rows`, `tokens` (the real tokens of the
    inputs it covers), `complete`, `array(key)` (a site's rows, or "input"/"position", memory-mapped: `RowArray`)
    and `batches(...)`. model: a Model to check the store against (its config, weights and products); a store of
    another one is refused, naming what differs. Only the shards the manifest names are read."""

    def __init__(self, directory: str | Path, model=None):
        self.directory = Path(directory)
        manifest = read_manifest(self.directory)
        if manifest is None:
            raise ActivationStoreError(f"{self.directory}: no {MANIFEST}; not an activation store (see collect)")
        self.manifest = manifest
        if model is not None:
            asked = model_identity(model.config, model.weights, model.native.active)
            diff = differences(manifest["model"], asked)
            if diff:
                raise ActivationStoreError(
                    f"{self.directory}: the store was collected from another model ({'; '.join(diff)})"
                )
        self.sites = {s["key"]: Site(s["key"], s["source"], s["layer"], tuple(s["shape"])) for s in manifest["layout"]}
        self.dtype = STORE_DTYPES[manifest["dtype"]]
        self.complete = bool(manifest["complete"])
        self.rows = sum(s["rows"] for s in manifest["shards"])
        self.tokens = int(manifest["tokens"])
        self._files: list[SafetensorsFile] = []
        for entry in manifest["shards"]:
            path = self.directory / entry["file"]
            try:
                shard = SafetensorsFile(path, _SHARD_DTYPES)
            except CheckpointError as e:
                raise ActivationStoreError(f"{path}: a shard the manifest names cannot be read ({e})") from e
            expected = set(self.sites) | set(INDEX_COLUMNS)
            if set(shard.names) != expected:
                raise ActivationStoreError(
                    f"{path}: holds {sorted(shard.names)}, the manifest names {sorted(expected)}; the shard is corrupt"
                )
            self._files.append(shard)

    def __repr__(self) -> str:
        state = "complete" if self.complete else "partial"
        return (
            f"ActivationStore({self.directory}: {self.rows:,} rows of {len(self.sites)} sites, {len(self._files)}"
            f" shard{'' if len(self._files) == 1 else 's'}, {self.manifest['dtype']}, {state})"
        )

    def array(self, key: str) -> RowArray:
        if key not in self.sites and key not in INDEX_COLUMNS:
            raise InvalidArgumentError(f"the store holds no site {key!r}; it holds {', '.join(self.sites)}")
        if not self._files:
            shape = (0, *self.sites[key].shape) if key in self.sites else (0,)
            return RowArray([np.empty(shape, self.dtype if key in self.sites else np.int32)])
        return RowArray([f.memmap(key) for f in self._files])

    def batches(
        self, batch_size: int, keys: Sequence[str] | None = None, seed: int | None = 0, drop_last: bool = False
    ) -> Iterator[dict[str, np.ndarray]]:
        """Batches of rows, key → [batch_size, *shape] (the last batch smaller unless drop_last), of the named
        sites (default all, plus "input" and "position"); shuffled by a permutation drawn from seed (None: in
        the stored order). One pass over the rows."""
        check_count(batch_size, "batch_size")
        arrays = {k: self.array(k) for k in (list(self.sites) + list(INDEX_COLUMNS) if keys is None else keys)}
        order = np.arange(self.rows) if seed is None else np.random.default_rng(seed).permutation(self.rows)
        end = self.rows - self.rows % batch_size if drop_last else self.rows
        for start in range(0, end, batch_size):
            rows = order[start : start + batch_size]
            yield {k: a.take(rows) for k, a in arrays.items()}
