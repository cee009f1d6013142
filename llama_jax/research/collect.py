"""Collecting activations over a data set into an `ActivationStore` on disk, resumably, in bounded memory.

`collect` runs one jitted pass over padded batches of inputs (the layers up to the deepest site asked for, the head
only for nf or logits), keeps the named sites at the chosen positions (padding never), and appends the rows to
fixed-size shards written by a background thread while the next batch computes. Memory holds the batch on the
device, the one before it on the host, the rows of the shard being filled and the shard being written: a few
batches and two shards, whatever the data set's size. Killed at any moment, the same call resumes from the
manifest (`store`): inputs already covered are read and hashed again, not computed, and every row is written once.
Each row equals `Model.activations` of its input alone, bit for bit (llama-jax is batch-invariant).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int
from safetensors import TensorSpec, serialize_file

from llama_jax.core.buckets import bucket, padded_block
from llama_jax.core.config import LlamaConfig
from llama_jax.core.weights import Weights
from llama_jax.errors import ActivationStoreError, InvalidArgumentError
from llama_jax.model import Model
from llama_jax.nn.block import ACT_NAMES
from llama_jax.nn.head import embed, unembed
from llama_jax.passes.checks import check_count, check_ids, ids_of
from llama_jax.passes.forward import positions_from_zero, run_layers
from llama_jax.research.store import (
    FORMAT,
    INDEX_COLUMNS,
    MANIFEST,
    POSITION_RULES,
    STORE_DTYPES,
    ActivationStore,
    differences,
    model_identity,
    parse_sites,
    read_manifest,
    shard_name,
    write_atomically,
    write_manifest,
)
from llama_jax.runtime.executables import persistent_jit

Input = str | Sequence[int]
SHARD_MB = 64  # default shard size


@persistent_jit(static_argnames=("config", "sources", "dtype", "native"))
def site_values(
    weights: Weights,
    tokens: Int[Array, "B T"],
    config: LlamaConfig,
    sources: tuple[tuple[str, int | None], ...],
    dtype: str,
    native: bool,
) -> tuple[Array, ...]:
    """Each (site, layer) of sources at every position of B sequences from position 0, [B, T, width] in dtype
    (config, sources, dtype and native static): the layers run as far as the deepest layer asked for, the final
    norm and the head only where nf or logits are asked for, each number as `forward` computes it."""
    b, t = tokens.shape
    head = any(source in ("nf", "logits") for source, _ in sources)
    depth = config.layers if head else max((layer + 1 for _, layer in sources if layer is not None), default=1)
    keep = tuple(name for name in ACT_NAMES if any(source == name for source, _ in sources))
    x = embed(weights, tokens, config)  # [B, T, D]
    y, _, acts = run_layers(weights, x, positions_from_zero(b, t), config, None, keep, None, native, depth=depth)
    nf, logits = unembed(weights, y, config, native) if head else (None, None)  # [B, T, D], [B, T, V]
    named = {"embeds": x, "nf": nf, "logits": logits}
    values = [named[s] if layer is None else getattr(acts, s)[layer] for s, layer in sources]  # [B, T, width] each
    return tuple(v.astype(STORE_DTYPES[dtype]) for v in values)


def _input_digest(previous: bytes, ids: np.ndarray, mask: np.ndarray | None) -> bytes:
    """The chained digest of the inputs so far after one more (its ids, and its mask where masks are given)."""
    h = hashlib.blake2b(previous, digest_size=16)
    h.update(np.int64(ids.size).tobytes() + ids.astype("<i4").tobytes())
    if mask is not None:
        h.update(mask.astype(np.uint8).tobytes())
    return h.digest()


class _Shards:
    """The rows not yet in a shard, cut into shards of the manifest's shard_rows as they fill, each written (then
    the manifest) by one background thread, at most one write in flight. marks[i]: the digest of inputs 0..i and
    their token count, for the manifest of a shard that ends in or after input i."""

    def __init__(self, directory: Path, manifest: dict, keys: list[str]):
        self.directory, self.manifest = directory, manifest
        self.columns: dict[str, list[np.ndarray]] = {k: [] for k in [*keys, *INDEX_COLUMNS]}
        self.ends: list[tuple[int, int, int]] = []  # per buffered row: its input, its index among the input's, count
        self.marks: dict[int, tuple[bytes, int]] = {}
        self.buffered = 0
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llama-jax-store")
        self.pending: Future | None = None

    def add(self, i: int, columns: dict[str, np.ndarray], skip: int) -> None:
        """Input i's rows (each column [R, ...]), the first `skip` of them stored already."""
        count = len(columns["input"])
        for k, v in columns.items():
            self.columns[k].append(v[skip:])
        self.ends += [(i, r, count) for r in range(skip, count)]
        self.buffered += count - skip
        while self.buffered >= self.manifest["shard_rows"]:
            self.flush(self.manifest["shard_rows"])

    def flush(self, rows: int) -> None:
        """The first `rows` buffered rows, written as the next shard in the background."""
        joined = {k: np.concatenate(v) for k, v in self.columns.items()}
        shard = {k: np.ascontiguousarray(v[:rows]) for k, v in joined.items()}
        self.columns = {k: [v[rows:]] for k, v in joined.items()}
        i, r, n = self.ends[rows - 1]
        self.ends, self.buffered = self.ends[rows:], self.buffered - rows
        cursor = (i + 1, 0) if r + 1 == n else (i, r + 1)  # the next row to write: its input, its index there
        covered = cursor[0] + (cursor[1] > 0)  # the inputs whose rows are stored, in whole or in part
        digest, _ = self.marks[covered - 1]
        tokens = self.marks[cursor[0] - 1][1] if cursor[0] else 0  # of the inputs stored whole
        self.marks = {k: m for k, m in self.marks.items() if k >= cursor[0] - 1}
        self.wait()
        self.pending = self.writer.submit(self._write, shard, cursor, covered, digest.hex(), tokens)

    def _write(self, shard: dict[str, np.ndarray], cursor, covered: int, digest: str, tokens: int) -> None:
        name = shard_name(len(self.manifest["shards"]))
        specs = {
            k: TensorSpec(dtype=v.dtype.name, shape=v.shape, data_ptr=v.ctypes.data, data_len=v.nbytes)
            for k, v in shard.items()
        }
        write_atomically(self.directory / name, lambda p: serialize_file(specs, str(p)))
        inputs = [int(shard["input"][0]), int(shard["input"][-1])]
        self.manifest["shards"].append({"file": name, "rows": len(shard["input"]), "inputs": inputs})
        self.manifest["cursor"] = {"input": cursor[0], "row": cursor[1]}
        self.manifest["inputs"] = {"covered": covered, "digest": digest}
        self.manifest["tokens"] = tokens
        write_manifest(self.directory, self.manifest)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.result()  # a failed write raises here
            self.pending = None


def _read_inputs(
    model: Model, inputs: Iterable[Input], positions: str | Iterable[np.ndarray]
) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
    """Each input's index, ids (checked) and mask (None unless positions are masks)."""
    masks = None if isinstance(positions, str) else iter(positions)
    for i, item in enumerate(inputs):
        where = f"input {i}: "
        ids = check_ids(ids_of(item, model.tokenizer.encode, where), model.config, where, "split it")
        mask = None
        if masks is not None:
            mask = next(masks, None)
            if mask is None:
                raise InvalidArgumentError(f"positions holds fewer masks than there are inputs (none for input {i})")
            mask = np.asarray(mask)
            if mask.dtype != bool or mask.shape != ids.shape:
                raise InvalidArgumentError(
                    f"input {i}: its mask must be booleans of its length {ids.size}, got {mask.dtype} {mask.shape}"
                )
        yield i, ids, mask


def _selected(ids: np.ndarray, mask: np.ndarray | None, rule: str) -> np.ndarray:
    """The positions of one input whose rows are stored."""
    if rule == "last":
        return np.array([ids.size - 1])
    return np.arange(ids.size) if mask is None else np.nonzero(mask)[0]


def collect(
    model: Model,
    inputs: Iterable[Input],
    sites: str | Sequence[str],
    out_dir: str | Path,
    batch_size: int = 8,
    positions: str | Iterable[np.ndarray] = "all",
    dtype: str = "float32",
    shard_mb: float = SHARD_MB,
    progress: bool | None = None,
) -> ActivationStore:
    """Runs the model over inputs (texts or token ids; any iterable, read once, in order) in batches of batch_size
    and stores the named sites (see `store`: 'y.6', 'y' for every layer, 'blocks.6.hook_resid_post', ...) at the
    chosen positions: "all" (every token of each input), "last" (each input's last token), or an iterable of
    boolean masks, one per input, of its length. Rows are stored in dtype (float32, bfloat16 or float16) in shards
    of about shard_mb MB under out_dir, which must be new, empty, or a store of the same run: then the run resumes
    where it stopped (a finished store is returned as it is). progress: a bar of tokens per second (default: when
    stderr is a terminal). Returns the store, opened for reading."""
    check_count(batch_size, "batch_size")
    if dtype not in STORE_DTYPES:
        raise InvalidArgumentError(f"dtype {dtype!r}: the store keeps {', '.join(STORE_DTYPES)}")
    if isinstance(positions, str) and positions not in POSITION_RULES[:2]:
        raise InvalidArgumentError(f"positions={positions!r}: 'all', 'last', or one boolean mask per input")
    if not (isinstance(shard_mb, (int, float)) and shard_mb > 0):
        raise InvalidArgumentError(f"shard_mb must be a positive number, got {shard_mb!r}")
    config = model.config
    parsed = parse_sites(sites, config)
    row_bytes = sum(int(np.prod(s.shape)) for s in parsed) * STORE_DTYPES[dtype].itemsize + 4 * len(INDEX_COLUMNS)
    directory = Path(out_dir)
    manifest = _start(directory, model, parsed, positions, dtype, max(1, int(shard_mb * 2**20) // row_bytes))
    if manifest["complete"]:  # the same run finished: its inputs must be these
        digest, count = b"", 0
        for i, ids, mask in _read_inputs(model, inputs, positions):
            digest, count = _input_digest(digest, ids, mask), i + 1
        if (count, digest.hex()) != (manifest["inputs"]["covered"], manifest["inputs"]["digest"]):
            raise ActivationStoreError(
                f"{directory}: a finished store of {manifest['inputs']['covered']} other inputs (these are {count});"
                " collect these into a new directory"
            )
        return ActivationStore(directory)
    cursor, covered = manifest["cursor"], manifest["inputs"]["covered"]
    rule = positions if isinstance(positions, str) else "mask"
    sources = tuple((s.source, s.layer) for s in parsed)
    shards = _Shards(directory, manifest, [s.key for s in parsed])
    show = sys.stderr.isatty() if progress is None else progress
    from tqdm import tqdm  # here: a progress stack costs start-up time

    bar = tqdm(desc="collecting", unit="tok", unit_scale=True, disable=not show)

    def run(batch, pending):
        """Starts a batch on the device (padded to its length bucket and to batch_size rows), then stores the
        rows of the batch before it while this one computes; returns this one."""
        length = bucket(max(ids.size for _, ids, _, _ in batch), config.context)
        block = padded_block([ids for _, ids, _, _ in batch], length, batch_size)  # [B, T]
        values = site_values(model.weights, jnp.asarray(block), config, sources, dtype, model.native.active)
        if pending is not None:
            store(*pending)
        bar.update(sum(ids.size for _, ids, _, _ in batch))
        return values, batch

    def store(values, batch) -> None:
        host = [np.asarray(v) for v in values]  # [B, T, width] each
        for row, (i, ids, mask, skip) in enumerate(batch):
            chosen = _selected(ids, mask, rule)  # [R]: the positions stored
            columns = {s.key: host[k][row, chosen].reshape(-1, *s.shape) for k, s in enumerate(parsed)}
            columns |= {"input": np.full(chosen.size, i, np.int32), "position": chosen.astype(np.int32)}
            shards.add(i, columns, skip)

    digest, tokens, count = b"", 0, 0
    try:
        batch, pending = [], None
        for i, ids, mask in _read_inputs(model, inputs, positions):
            digest, tokens, count = _input_digest(digest, ids, mask), tokens + ids.size, i + 1
            shards.marks[i] = (digest, tokens)
            if count == covered and digest.hex() != manifest["inputs"]["digest"]:
                raise ActivationStoreError(
                    f"{directory}: the first {covered} inputs differ from the ones the store was collected from;"
                    " resume with the same inputs (and masks), or collect into a new directory"
                )
            if i < cursor["input"]:
                continue  # its rows are stored
            batch.append((i, ids, mask, cursor["row"] if i == cursor["input"] else 0))
            if len(batch) == batch_size:
                batch, pending = [], run(batch, pending)
        if batch:
            pending = run(batch, pending)
        if pending is not None:
            store(*pending)
        if count < covered:
            raise ActivationStoreError(
                f"{directory}: the store covers {covered} inputs but only {count} were given; resume with the same"
                " inputs, or collect into a new directory"
            )
        if shards.buffered:
            shards.flush(shards.buffered)
        shards.wait()
    finally:
        bar.close()
        shards.writer.shutdown(wait=True)
    manifest |= {"complete": True, "cursor": {"input": count, "row": 0}, "tokens": tokens}
    manifest["inputs"] = {"covered": count, "digest": digest.hex()}
    write_manifest(directory, manifest)
    return ActivationStore(directory)


def _written_here(name: str) -> bool:
    """A file a run of collect writes: the manifest, a shard, or either's temporary name."""
    return name.removesuffix(".tmp") == MANIFEST or (name.startswith("shard-") and ".safetensors" in name)


def _start(directory: Path, model: Model, sites, positions, dtype: str, shard_rows: int) -> dict:
    """The manifest of the run: the one in directory if it is a store of the same run (any file it does not name
    removed: shards or temporary files a killed run left), else a new one written to an empty directory."""
    rule = positions if isinstance(positions, str) else "mask"
    run = {
        "model": model_identity(model.config, model.weights, model.native.active),
        "sites": [s.key for s in sites],
        "positions": rule,
        "dtype": dtype,
    }
    manifest = read_manifest(directory)
    if manifest is None:
        files = list(directory.iterdir()) if directory.exists() else []
        if any(not _written_here(path.name) for path in files):
            raise ActivationStoreError(
                f"{directory}: holds files but no store manifest; collect into a new or empty directory"
            )
        for path in files:  # a run killed while it wrote its first manifest
            path.unlink()
        directory.mkdir(parents=True, exist_ok=True)
        layout = [{"key": s.key, "source": s.source, "layer": s.layer, "shape": list(s.shape)} for s in sites]
        manifest = {
            "format": FORMAT,
            **run,
            "layout": layout,
            "shard_rows": shard_rows,
            "shards": [],
            "complete": False,
        }
        manifest |= {"cursor": {"input": 0, "row": 0}, "inputs": {"covered": 0, "digest": ""}, "tokens": 0}
        write_manifest(directory, manifest)
        return manifest
    diff = differences({k: manifest[k] for k in run}, run)
    if diff:
        raise ActivationStoreError(
            f"{directory}: a store of another run ({'; '.join(diff)}); resume with the same model and settings, or"
            " collect into a new directory"
        )
    named = {MANIFEST} | {s["file"] for s in manifest["shards"]}
    for path in directory.iterdir():
        if path.name not in named and _written_here(path.name):
            path.unlink()  # written by a run killed before its manifest named it
    return manifest
