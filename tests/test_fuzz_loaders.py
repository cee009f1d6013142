"""Seeded fuzzing of the checkpoint loaders: mutated safetensors headers, config.json files and GGUF headers.

Every case must end in one of two ways: a clean load whose logits on a short id sequence are all finite, or an
exception that is a `LlamaJaxError` (raised while loading, or by the logits call, e.g. a context too short for the
ids). Anything else fails the test, naming the case's seed and mutation: another exception, non-finite logits, a case
slower than CASE_SECONDS, or (for safetensors) a file that the safetensors library itself refuses but llama-jax loads.

The seeds are fixed, so CI runs the same cases every time; case i of a kind draws from
`np.random.default_rng((SEED, kind, i))`. The checkpoints are tiny (built from `llama_jax.testing`), except in
`test_fuzz_real_gguf_header`, which mutates a copy of the real SmolLM2 file's header (slow: a clean load reads the
real weights). Each test prints its counts: cases, clean loads, refusals by class (`pytest -s` shows them).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import safetensors.numpy
from safetensors.numpy import save_file

import llama_jax
from llama_jax.testing import byte_tokenizer, random_tensors, tiny_config
from tests.gguf_builder import gguf_metadata, write_gguf

# fixed, so that CI runs the same cases every time; a deeper run by hand: LLAMA_JAX_FUZZ_SEED, LLAMA_JAX_FUZZ_SCALE
SEED = int(os.environ.get("LLAMA_JAX_FUZZ_SEED", "807"))
SCALE = int(os.environ.get("LLAMA_JAX_FUZZ_SCALE", "1"))  # cases per kind, × the counts below
CASE_SECONDS = 20  # a case slower than this fails (a hang is interrupted at 3× this)
IDS = [1, 2, 3, 4]
CONFIG = tiny_config(ffn=32)  # dim 32, ffn 32: every matrix quantizes into 32-number blocks
Q = gguf.GGMLQuantizationType
DIGITS = b"0123456789"
JSON_BYTES = b'0123456789{}[]":,.-+eE \t\n'


class CaseTimeout(Exception):
    """A case ran past 3 × CASE_SECONDS (raised by SIGALRM)."""


@contextlib.contextmanager
def alarm(seconds: int) -> Iterator[None]:
    def interrupt(signum, frame):
        raise CaseTimeout(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class Fuzz:
    """Runs cases and tallies their outcomes: "loaded", or the class of the LlamaJaxError (with "at logits: " when
    the logits call raised it); anything else is a failure."""

    def __init__(self, name: str):
        self.name = name
        self.outcomes: Counter[str] = Counter()
        self.by_kind: dict[str, Counter[str]] = {}
        self.failures: list[str] = []
        self.library_refused = 0
        self.not_written = 0

    def run(self, kind: str, case: str, path: Path, library_refuses: bool = False) -> None:
        """Loads `path`; `case` names the seed and the mutation in a failure's message."""
        start = time.perf_counter()
        outcome, problem = None, None
        try:
            with alarm(3 * CASE_SECONDS):
                try:
                    ck = llama_jax.load_checkpoint(path)
                except llama_jax.LlamaJaxError as e:
                    outcome = type(e).__name__
                else:
                    try:
                        logits = llama_jax.Model(ck).logits(IDS)
                    except llama_jax.LlamaJaxError as e:
                        outcome = f"at logits: {type(e).__name__}"
                    else:
                        outcome = "loaded"
                        if not np.isfinite(logits).all():
                            problem = f"loaded, but {int((~np.isfinite(logits)).sum())} logits are not finite"
                        elif library_refuses:
                            problem = "loaded, but the safetensors library refuses this file"
        except Exception as e:  # the failure this test exists to find: a foreign exception (or a hang)
            problem = f"{type(e).__name__}: {e}"
        elapsed = time.perf_counter() - start
        if problem is None and elapsed > CASE_SECONDS:
            problem = f"took {elapsed:.1f} s"
        if problem is not None:
            self.failures.append(f"{kind} {case}: {problem}")
            outcome = "FAILED"
        self.library_refused += library_refuses
        self.outcomes[outcome] += 1
        self.by_kind.setdefault(kind, Counter())[outcome] += 1

    def report(self, require_loads: bool = True) -> None:
        """Prints the counts, then fails with every failing case."""
        total = sum(self.outcomes.values())
        refused = total - self.outcomes["loaded"] - self.outcomes["FAILED"]
        print(f"\n{self.name}: {total} cases, {self.outcomes['loaded']} loaded cleanly, {refused} refused")
        for outcome, n in self.outcomes.most_common():
            print(f"  {n:4d}  {outcome}")
        for kind, counts in self.by_kind.items():
            print(f"  {kind}: {dict(counts.most_common())}")
        if self.library_refused:
            print(f"  the safetensors library refused {self.library_refused} of the files (llama-jax must refuse each)")
        if self.not_written:
            print(f"  ({self.not_written} drawn metadata values gguf's writer refused to write: not cases)")
        assert not self.failures, f"{len(self.failures)} of {total} cases failed:\n" + "\n".join(self.failures)
        assert refused and (self.outcomes["loaded"] or not require_loads), "the fuzz should see loads and refusals"


def rng_for(kind: int, i: int) -> np.random.Generator:
    return np.random.default_rng((SEED, kind, i))


def pick(rng: np.random.Generator, options: list | tuple) -> Any:
    return options[int(rng.integers(len(options)))]


def overwrite(data: bytes, rng: np.random.Generator, lo: int, hi: int, alphabet: bytes | None = None) -> tuple:
    """1..4 bytes in [lo, hi) overwritten (with random bytes, or bytes of `alphabet`): the new data, a description."""
    out = bytearray(data)
    changes = []
    for _ in range(int(rng.integers(1, 5))):
        at = int(rng.integers(lo, hi))
        value = int(rng.integers(256)) if alphabet is None else alphabet[int(rng.integers(len(alphabet)))]
        changes.append(f"byte {at}: {out[at]:#04x}->{value:#04x}")
        out[at] = value
    return bytes(out), ", ".join(changes)


def draw_value(rng: np.random.Generator) -> Any:
    """A JSON value of a random kind, biased to the edges: 0, negatives, huge numbers, other types."""
    kind = int(rng.integers(9))
    if kind == 0:
        return pick(rng, [0, 1, -1, 2, 3, 7, 16, 31, 32, 64, 256, 257, 259, 260, 2**31, 2**63, 10**30])
    if kind == 1:
        return int(rng.integers(-5, 100))
    if kind == 2:
        return pick(rng, [0.0, -1e-5, 1e-45, 1e-30, 1e30, 1e300, 0.5, 1.5, 32.0, float("nan"), float("inf")])
    if kind == 3:
        return pick(rng, ["", "llama", "mistral", "32", "default", "linear", "silu", "gelu"])
    if kind == 4:
        return None
    if kind == 5:
        return bool(rng.integers(2))
    if kind == 6:
        return [int(v) for v in rng.integers(0, 300, int(rng.integers(0, 4)))]
    if kind == 7:
        return {"rope_type": pick(rng, ["default", "llama3", "linear"]), "factor": 2.0}
    return float(rng.standard_normal() * 10 ** int(rng.integers(-8, 8)))


# ---- a Hugging Face directory: the safetensors header and config.json ----


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory) -> dict[str, bytes]:
    """The files of a valid tiny directory, as bytes (each case writes them afresh, one of them mutated)."""
    directory = tmp_path_factory.mktemp("hf_base")
    save_file(random_tensors(CONFIG), str(directory / "model.safetensors"))
    byte_tokenizer().save(directory / "tokenizer.json")
    (directory / "config.json").write_text(json.dumps(CONFIG.to_hf()))
    return {name: (directory / name).read_bytes() for name in ("model.safetensors", "tokenizer.json", "config.json")}


def safetensors_header(data: bytes) -> tuple[int, dict[str, Any]]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n])


def with_header(header: dict[str, Any], payload: bytes) -> bytes:
    """A safetensors file of this header (padded with spaces to 8 bytes, as the library writes it) and data."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + payload


def mutate_header_entry(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """One structural change to the JSON header: a tensor's offsets, shape or dtype, or an entry removed, duplicated or
    renamed; the header length is rewritten to fit."""
    n, header = safetensors_header(data)
    payload = data[8 + n :]
    names = [k for k in header if k != "__metadata__"]
    name = names[int(rng.integers(len(names)))]
    other = names[int(rng.integers(len(names)))]
    entry = header[name]
    begin, end = entry["data_offsets"]
    delta = int(pick(rng, [1, -1, 2, -2, 4, -4, 8, -8, 64, -64, 4096]))
    op = int(rng.integers(14))
    if op == 0:
        entry["data_offsets"] = [begin + delta, end + delta]
    elif op == 1:
        entry["data_offsets"] = [begin, end + delta]
    elif op == 2:
        entry["data_offsets"] = [begin + delta, end]
    elif op == 3:
        entry["data_offsets"], header[other]["data_offsets"] = header[other]["data_offsets"], [begin, end]
    elif op == 4:
        entry["data_offsets"] = list(header[other]["data_offsets"])
    elif op == 5:
        i = int(rng.integers(len(entry["shape"])))
        entry["shape"][i] += delta
    elif op == 6:
        entry["shape"] = entry["shape"][::-1]
    elif op == 7:
        entry["shape"] = [*entry["shape"], 1] if rng.integers(2) else entry["shape"][1:]
    elif op == 8:
        entry["dtype"] = pick(rng, ["F16", "BF16", "F64", "I32", "U8", "F8_E4M3", "f32", "", None, 32])
    elif op == 9:
        del entry[pick(rng, ["dtype", "shape", "data_offsets"])]
    elif op == 10:
        del header[name]
    elif op == 11:
        header[name + ".copy"] = dict(entry)
    elif op == 12:
        header[repr(draw_value(rng))] = header.pop(name)
    else:
        entry[pick(rng, ["data_offsets", "shape", "dtype"])] = draw_value(rng)
    return with_header(header, payload), f"op {op} on {name!r} (other {other!r}, delta {delta}): {entry}"


def mutate_length(data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """The u64 header length: off by a few bytes, a flipped bit, or random."""
    (n,) = struct.unpack("<Q", data[:8])
    how = int(rng.integers(3))
    if how == 0:
        m = n + int(rng.choice([-16, -9, -8, -7, -3, -2, -1, 1, 2, 3, 7, 8, 9, 16]))
    elif how == 1:
        m = n ^ (1 << int(rng.integers(64)))
    else:
        m = int(rng.integers(2**63))
    return struct.pack("<Q", m) + data[8:], f"header length {n} -> {m}"


def mutate_safetensors(kind: str, data: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    n, _ = safetensors_header(data)
    if kind == "st-header-bytes":
        if rng.integers(2):  # a digit for a digit: offsets and shapes change, the JSON stays valid
            digits = [i for i in range(8, 8 + n) if data[i] in DIGITS]
            at = digits[int(rng.integers(len(digits)))]
            return overwrite(data, rng, at, at + 1, DIGITS)
        return overwrite(data, rng, 8, 8 + n, JSON_BYTES if rng.integers(2) else None)
    if kind == "st-header-json":
        return mutate_header_entry(data, rng)
    if kind == "st-length":
        return mutate_length(data, rng)
    if kind == "st-append":
        extra = int(rng.integers(1, 65))
        return data + bytes(extra), f"{extra} bytes appended"
    cut = int(rng.integers(len(data)))
    return data[:cut], f"cut at byte {cut} of {len(data)}"


def library_refuses(path: Path) -> bool:
    """Whether the safetensors library itself refuses the file."""
    try:
        safetensors.numpy.load_file(str(path))
    except Exception:  # the library's SafetensorError, or whatever else it raises for a bad file
        return True
    return False


def mutate_config(text: bytes, rng: np.random.Generator) -> tuple[bytes, str]:
    """config.json: a field deleted, or set to a random value of a random type (one or two fields), or bytes of the
    text overwritten."""
    if rng.integers(8) == 0:
        return overwrite(text, rng, 0, len(text), JSON_BYTES)
    hf = json.loads(text)
    keys = [*hf, "rope_scaling", "rope_parameters", "eos_token_id", "bos_token_id", "pretraining_tp", "sliding_window"]
    changes = []
    for _ in range(int(rng.integers(1, 3))):
        key = keys[int(rng.integers(len(keys)))]
        if rng.integers(4) == 0:
            hf.pop(key, None)
            changes.append(f"{key} deleted")
        else:
            hf[key] = draw_value(rng)
            changes.append(f"{key}={hf[key]!r}")
    return json.dumps(hf).encode(), ", ".join(changes)


HF_KINDS = {  # kind -> number of cases
    "st-header-bytes": 50,
    "st-header-json": 50,
    "st-length": 25,
    "st-append": 5,
    "st-truncate": 15,
    "config": 70,
}


def test_fuzz_hf_directory(hf_base, tmp_path):
    """Mutated safetensors headers (bytes, structure, the length field, appended or cut data) and config.json
    files: a clean load with finite logits, or a LlamaJaxError; never a file the safetensors library refuses."""
    fuzz = Fuzz("HF directory (safetensors header, config.json)")
    directory = tmp_path / "ckpt"
    directory.mkdir()
    for k, (kind, count) in enumerate(HF_KINDS.items()):
        for i in range(count * SCALE):
            rng = rng_for(k, i)
            files = dict(hf_base)
            if kind == "config":
                files["config.json"], mutation = mutate_config(hf_base["config.json"], rng)
            else:
                files["model.safetensors"], mutation = mutate_safetensors(kind, hf_base["model.safetensors"], rng)
            for name, data in files.items():
                (directory / name).write_bytes(data)
            refuses = kind != "config" and library_refuses(directory / "model.safetensors")
            fuzz.run(kind, f"seed {(SEED, k, i)}, {mutation}", directory, refuses)
    fuzz.report()


# ---- GGUF files: the header, the tensor records, the metadata values ----


def tensor_records(data: bytes, names: list[str]) -> dict[str, tuple[int, int]]:
    """Each tensor's record in the header: (start of its name's length, end of its u64 offset)."""
    records = {}
    for name in names:
        start = data.index(struct.pack("<Q", len(name)) + name.encode())
        at = start + 8 + len(name)
        (n_dims,) = struct.unpack("<I", data[at : at + 4])
        records[name] = (start, at + 4 + 8 * n_dims + 4 + 8)
    return records


class GGUFBase:
    """A valid GGUF file's first `size` bytes (all of it by default), where its data starts and where each tensor
    record lies."""

    def __init__(self, path: Path, size: int = -1):
        with open(path, "rb") as f:
            self.data = f.read(size)
        tensors = gguf.GGUFReader(path).tensors
        self.names = [t.name for t in tensors]
        self.records = tensor_records(self.data, self.names)
        self.data_start = min(int(t.data_offset) for t in tensors)


@pytest.fixture(scope="module")
def gguf_bases(tmp_path_factory) -> dict[str, tuple[GGUFBase, Callable[..., bytes]]]:
    """Three tiny GGUF files (F32 tied; Q8_0 untied; Q4_1 tied), and a function rebuilding each with other metadata."""
    directory = tmp_path_factory.mktemp("gguf_base")
    bases = {}
    for label, ggml_type, tied in [("f32", Q.F32, True), ("q8_0", Q.Q8_0, False), ("q4_1", Q.Q4_1, True)]:
        config = tiny_config(ffn=32, tied=tied)
        tensors = random_tensors(config)

        def build(path: Path, config=config, tensors=tensors, ggml_type=ggml_type, **meta: Any) -> bytes:
            return write_gguf(path, config, tensors, ggml_type, **meta).read_bytes()

        build(directory / f"{label}.gguf")
        bases[label] = (GGUFBase(directory / f"{label}.gguf"), build)
    return bases


def mutate_record(base: GGUFBase, rng: np.random.Generator) -> tuple[bytes, str]:
    """One field of one tensor record (n_dims, a dimension, the type, the offset) set to a nearby or an edge value,
    or bytes of the record (its name included) overwritten."""
    name = base.names[int(rng.integers(len(base.names)))]
    start, end = base.records[name]
    data = base.data
    at = start + 8 + len(name)
    (n_dims,) = struct.unpack("<I", data[at : at + 4])
    field = int(rng.integers(5))
    if field == 0:
        value = pick(rng, [0, 1, 2, 3, 4, 5, 2**31, int(rng.integers(2**32))])
        where, raw = at, struct.pack("<I", value)
    elif field == 1:
        i = int(rng.integers(n_dims))
        where = at + 4 + 8 * i
        (d,) = struct.unpack("<Q", data[where : where + 8])
        value = pick(rng, [d + 1, d - 1, d + 32, d * 2, d // 2, 0, 32, 2**40, 2**63, int(rng.integers(2**63))])
        raw = struct.pack("<Q", value % 2**64)
    elif field == 2:
        where = at + 4 + 8 * n_dims
        types = [int(t) for t in Q]
        value = types[int(rng.integers(len(types)))] if rng.integers(4) else int(rng.integers(2**32))
        raw = struct.pack("<I", value)
    elif field == 3:
        where = at + 4 + 8 * n_dims + 4
        (offset,) = struct.unpack("<Q", data[where : where + 8])
        value = offset + int(rng.choice([-64, -32, -1, 1, 4, 32, 64, 96, 2**20, 2**40]))
        raw = struct.pack("<Q", value % 2**64)
    else:
        out, changes = overwrite(data, rng, start, end)
        return out, f"tensor {name!r} record: {changes}"
    what = ["n_dims", "a dimension", "type", "offset"][field]
    return data[:where] + raw + data[where + len(raw) :], f"tensor {name!r}: {what} -> {value}"


def draw_meta(rng: np.random.Generator, meta: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """Metadata changes write_gguf can write: a key dropped (None), or a value of another size or type."""
    keys = [
        *meta,
        "general.alignment",
        "llama.rope.scaling.type",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.chat_template",
    ]
    key = keys[int(rng.integers(len(keys)))]
    kind = int(rng.integers(6))
    if kind == 0:
        value: Any = None
    elif kind == 1:
        value = pick(rng, [0, 1, 2, 3, 4, 8, 16, 31, 32, 64, 256, 259, 260, 2048, 2**31])
    elif kind == 2:
        value = pick(rng, [0.0, -1.0, 1e-30, 1e-5, 0.5, 1.0, 2.0, 1e30, float("nan"), float("inf")])
    elif kind == 3:
        value = pick(rng, ["", "llama", "gpt2", "smollm", "linear", "none", "x"])
    elif kind == 4:
        value = [int(v) for v in rng.integers(0, 5, int(rng.integers(1, 4)))]
    else:
        value = ["a", "b c", "Ġ t"][: int(rng.integers(1, 4))]
    return {key.replace(".", "__"): value}, f"{key}={value!r}"


GGUF_KINDS = {"gguf-header-bytes": 45, "gguf-record": 75, "gguf-truncate": 15, "gguf-metadata": 30}


def test_fuzz_gguf(gguf_bases, tmp_path):
    """Mutated tiny GGUF files (F32, Q8_0, Q4_1): header bytes, tensor records, truncations, metadata values of other
    sizes and types: a clean load with finite logits, or a LlamaJaxError."""
    fuzz = Fuzz("GGUF (header, tensor records, metadata)")
    path = tmp_path / "fuzz.gguf"
    labels = list(gguf_bases)
    for k, (kind, count) in enumerate(GGUF_KINDS.items()):
        for i in range(count * SCALE):
            rng = rng_for(100 + k, i)
            label = labels[int(rng.integers(len(labels)))]
            base, build = gguf_bases[label]
            if kind == "gguf-header-bytes":
                data, mutation = overwrite(base.data, rng, 0, base.data_start)
            elif kind == "gguf-record":
                data, mutation = mutate_record(base, rng)
            elif kind == "gguf-truncate":
                cut = int(rng.integers(len(base.data)))
                data, mutation = base.data[:cut], f"cut at byte {cut} of {len(base.data)}"
            else:
                meta, mutation = draw_meta(rng, gguf_metadata(CONFIG))
                try:
                    data = build(tmp_path / "build.gguf", **meta)
                except Exception:  # a value gguf's writer itself refuses: not a file, not a case
                    fuzz.not_written += 1
                    continue
            path.write_bytes(data)
            fuzz.run(f"{kind} ({label})", f"seed {(SEED, 100 + k, i)}, {mutation}", path)
    fuzz.report()


# ---- the real SmolLM2 file's header ----


@pytest.mark.slow
def test_fuzz_real_gguf_header(default_path, tmp_path):
    """The real file's header, mutated in a copy (restored after each case): its scalar metadata, a few bytes of its
    vocabulary, and above all its 272 tensor records, where the earlier fuzzing found loads with NaN logits."""
    fuzz = Fuzz("real SmolLM2 GGUF header")
    path = tmp_path / default_path.name
    shutil.copyfile(default_path, path)
    base = GGUFBase(default_path, 4 << 20)  # the header is 1.8 MB
    head = base.data
    first_record = min(start for start, _ in base.records.values())
    tokens_at = head.index(b"tokenizer.ggml.tokens")
    scalars_end = head.index(b"tokenizer.ggml.bos_token_id") - 8
    kinds = {"real-record": 60, "real-metadata": 16, "real-vocabulary": 8}
    with open(path, "r+b") as f:
        for k, (kind, count) in enumerate(kinds.items()):
            for i in range(count * SCALE):
                rng = rng_for(200 + k, i)
                if kind == "real-record":
                    data, mutation = mutate_record(base, rng)
                elif kind == "real-metadata":  # the scalar keys before the vocabulary and after the merges
                    lo, hi = (0, tokens_at) if rng.integers(2) else (scalars_end, first_record)
                    data, mutation = overwrite(head, rng, lo, hi)
                else:
                    data, mutation = overwrite(head, rng, tokens_at, scalars_end)
                changed = np.flatnonzero(np.frombuffer(data, np.uint8) != np.frombuffer(head, np.uint8))
                span = (int(changed[0]), int(changed[-1]) + 1) if changed.size else (0, 0)
                f.seek(span[0])
                f.write(data[span[0] : span[1]])
                f.flush()
                fuzz.run(kind, f"seed {(SEED, 200 + k, i)}, {mutation}", path)
                f.seek(span[0])
                f.write(head[span[0] : span[1]])
                f.flush()
    fuzz.report(require_loads=False)
