"""The activation store (`research.collect`, `research.ActivationStore`): every row read back equals the model's
activations of its input alone, bit for bit; only the positions asked for are stored, never padding; a run killed
at any moment resumes without losing or repeating a row, and never reads a half-written file; a store of another
model, run or data set is refused by name."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import llama_jax
from llama_jax import research, testing
from llama_jax.errors import ActivationStoreError
from llama_jax.research.store import MANIFEST
from tests.helpers import PROMPTS

CHILD = Path(__file__).with_name("collect_child.py")
TIMEOUT = 120  # seconds for one child run (a few on 2 cores)

SITES = ["y.1", "blocks.0.attn.hook_q", "blocks.1.hook_resid_pre", "hidden", "embeds", "logits"]


@pytest.fixture(scope="module")
def tiny() -> llama_jax.Model:
    return testing.tiny_model(testing.tiny_config(layers=2))


def inputs(n: int = 23, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, int(rng.integers(1, 40))).tolist() for _ in range(n)]


def expected_rows(model, data, sites_of, positions=None) -> dict[str, np.ndarray]:
    """Every input's activations alone (Model.activations), at the positions given (default all), concatenated."""
    c = model.config
    out: dict[str, list] = {}
    for i, ids in enumerate(data):
        acts = model.activations(ids, keep=("q", "y", "hidden"))
        chosen = np.arange(len(ids)) if positions is None else positions(i, ids)
        values = sites_of(acts, c)
        values |= {"input": np.full(len(ids), i, np.int32), "position": np.arange(len(ids), dtype=np.int32)}
        for k, v in values.items():
            out.setdefault(k, []).append(v[chosen])
    return {k: np.concatenate(v) for k, v in out.items()}


def tiny_sites(acts, c) -> dict[str, np.ndarray]:
    t = acts["y"].shape[1]
    return {
        "y.1": acts["y"][1],
        "blocks.0.attn.hook_q": acts["q"][0].reshape(t, c.heads, c.head_dim),
        "blocks.1.hook_resid_pre": acts["y"][0],
        "hidden.0": acts["hidden"][0],
        "hidden.1": acts["hidden"][1],
        "embeds": acts["embeds"],
        "logits": acts["logits"],
    }


def read_all(store) -> dict[str, np.ndarray]:
    return {k: np.asarray(store.array(k)) for k in [*store.sites, "input", "position"]}


def test_every_stored_row_is_its_input_s_activations_alone_bit_for_bit(tiny, tmp_path):
    """Batches of mixed lengths (padded to their buckets and to batch_size rows), shards that split inputs: each
    row equals Model.activations of its input alone, in the inputs' order, TransformerLens hooks in their layout."""
    data = inputs()
    store = research.collect(tiny, data, SITES, tmp_path / "s", batch_size=4, shard_mb=0.02)
    assert store.complete and len(store.manifest["shards"]) > 3
    assert store.tokens == sum(map(len, data)) == store.rows
    got, want = read_all(store), expected_rows(tiny, data, tiny_sites)
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], k)


def test_only_the_positions_asked_for_are_stored(tiny, tmp_path):
    """positions="last": each input's last token; masks: exactly the masked positions (none for an all-False mask);
    the rows of padding are never stored."""
    data = inputs(9, seed=1)
    last = research.collect(tiny, data, ["y.1"], tmp_path / "last", batch_size=4, positions="last")
    want = expected_rows(tiny, data, tiny_sites, lambda i, ids: [len(ids) - 1])
    np.testing.assert_array_equal(np.asarray(last.array("y.1")), want["y.1"])
    np.testing.assert_array_equal(np.asarray(last.array("position")), [len(ids) - 1 for ids in data])
    rng = np.random.default_rng(2)
    masks = [rng.random(len(ids)) < 0.4 for ids in data]
    masks[3][:] = False
    masked = research.collect(tiny, data, ["y.1"], tmp_path / "mask", batch_size=2, positions=masks)
    want = expected_rows(tiny, data, tiny_sites, lambda i, ids: np.nonzero(masks[i])[0])
    for k in ("y.1", "input", "position"):
        np.testing.assert_array_equal(np.asarray(masked.array(k)), want[k], k)
    assert 3 not in np.asarray(masked.array("input"))


def test_a_narrower_dtype_stores_the_rounded_rows(tiny, tmp_path):
    """bfloat16 and float16 stores hold the float32 rows rounded once to that type."""
    data = inputs(5)
    want = expected_rows(tiny, data, tiny_sites)["y.1"]
    for dtype, np_dtype in (("bfloat16", ml_dtypes.bfloat16), ("float16", np.float16)):
        store = research.collect(tiny, data, ["y.1"], tmp_path / dtype, dtype=dtype)
        got = np.asarray(store.array("y.1"))
        assert got.dtype == np_dtype
        np.testing.assert_array_equal(got, want.astype(np_dtype))


def test_batches_are_one_seeded_pass_over_every_row(tiny, tmp_path):
    """batches(): a permutation of every row drawn from the seed (the same seed, the same order), each batch's
    columns from the same rows; seed None keeps the stored order; drop_last drops the short batch."""
    store = research.collect(tiny, inputs(), ["y.1"], tmp_path / "s", shard_mb=0.01)
    y, where = np.asarray(store.array("y.1")), np.asarray(store.array("input")) * 1000 + store.array("position")[:]
    rows = [b for b in store.batches(50, seed=3)]
    assert [len(b["y.1"]) for b in rows][:-1] == [50] * (len(rows) - 1)
    keys = np.concatenate([b["input"] * 1000 + b["position"] for b in rows])
    assert sorted(keys) == sorted(where) and list(keys) != list(where)
    order = {k: i for i, k in enumerate(where)}
    np.testing.assert_array_equal(np.concatenate([b["y.1"] for b in rows]), y[[order[k] for k in keys]])
    again = np.concatenate([b["input"] * 1000 + b["position"] for b in store.batches(50, seed=3)])
    np.testing.assert_array_equal(again, keys)
    stored = np.concatenate([b["y.1"] for b in store.batches(64, keys=["y.1"], seed=None, drop_last=True)])
    np.testing.assert_array_equal(stored, y[: len(y) // 64 * 64])


def test_a_store_of_another_run_is_refused_naming_what_differs(tiny, tmp_path):
    """Resuming or reading with another model (weights or config), other sites, another dtype, another position
    rule or other inputs is an ActivationStoreError naming the difference; so is a directory holding other files."""
    data = inputs(12)
    out = tmp_path / "s"
    research.collect(tiny, data, ["y.1"], out, shard_mb=0.01)
    other = testing.tiny_model(testing.tiny_config(layers=2), seed=4)
    with pytest.raises(ActivationStoreError, match="weights"):
        research.collect(other, data, ["y.1"], out)
    with pytest.raises(ActivationStoreError, match=r"another model .*weights"):
        research.ActivationStore(out, model=other)
    research.ActivationStore(out, model=tiny)
    wider = testing.tiny_model(testing.tiny_config(layers=3))
    with pytest.raises(ActivationStoreError, match=r"config\.layers: store 2, now 3"):
        research.collect(wider, data, ["y.1"], out)
    for change, pattern in [
        ({"sites": ["y.0"]}, "sites"),
        ({"dtype": "bfloat16"}, "dtype"),
        ({"positions": "last"}, "positions"),
    ]:
        settings = {"sites": ["y.1"]} | change
        with pytest.raises(ActivationStoreError, match=pattern):
            research.collect(tiny, data, settings.pop("sites"), out, **settings)
    partial = tmp_path / "partial"
    stopped_after(tiny, data, 9, partial)
    with pytest.raises(ActivationStoreError, match="inputs differ"):
        research.collect(tiny, inputs(12, seed=9), ["y.1"], partial)
    with pytest.raises(ActivationStoreError, match=r"covers \d inputs but only 2"):
        research.collect(tiny, data[:2], ["y.1"], partial)
    finished = research.collect(tiny, data, ["y.1"], out, shard_mb=0.01)  # the same run: returned as it is
    assert finished.complete and finished.rows == research.ActivationStore(out).rows
    with pytest.raises(ActivationStoreError, match="a finished store of 12 other inputs"):
        research.collect(tiny, data[:5], ["y.1"], out)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ActivationStoreError, match="holds files but no store manifest"):
        research.collect(tiny, data, ["y.1"], tmp_path / "other")


def test_files_the_manifest_does_not_name_are_never_read_and_are_replaced(tiny, tmp_path):
    """A run stopped by an error keeps the shards it finished; a half-written shard (its temporary name) and a
    shard the manifest does not name are left out by a reader and removed by the resumed run, which writes those
    rows once: the store ends equal to an uninterrupted run's."""
    data, out = inputs(12), tmp_path / "s"
    whole = read_all(research.collect(tiny, data, ["y.1"], tmp_path / "whole", shard_mb=0.01))
    stopped_after(tiny, data, 7, out)
    partial = research.ActivationStore(out)
    assert not partial.complete and 0 < partial.rows < len(whole["input"])
    names = [s["file"] for s in partial.manifest["shards"]]
    (out / f"shard-{len(names):05d}.safetensors.tmp").write_bytes(b"half a shard")
    (out / f"shard-{len(names) + 1:05d}.safetensors").write_bytes((out / names[0]).read_bytes())
    assert research.ActivationStore(out).rows == partial.rows
    resumed = read_all(research.collect(tiny, data, ["y.1"], out, shard_mb=0.01))
    assert not list(out.glob("*.tmp"))
    for k in whole:
        np.testing.assert_array_equal(resumed[k], whole[k], k)


def test_a_run_killed_while_it_wrote_its_first_manifest_starts_again(tiny, tmp_path):
    """A directory holding only a temporary manifest (a run killed before its first rename) is a new store."""
    out = tmp_path / "s"
    out.mkdir()
    (out / "manifest.json.tmp").write_text('{"format": "llama-jax act')
    store = research.collect(tiny, inputs(3), ["y.1"], out)
    assert store.complete and not list(out.glob("*.tmp"))


def test_rows_are_read_by_index_slice_array_and_mask(tiny, tmp_path):
    store = research.collect(tiny, inputs(6), ["y.1"], tmp_path / "s", shard_mb=0.01)
    y, rows = store.array("y.1"), np.asarray(store.array("y.1"))
    mask = np.arange(len(y)) % 3 == 0
    np.testing.assert_array_equal(y[mask], rows[mask])
    np.testing.assert_array_equal(y[[5, 0, 77]], rows[[5, 0, 77]])
    np.testing.assert_array_equal(y[10:90:7], rows[10:90:7])
    np.testing.assert_array_equal(y[-1], rows[-1])
    with pytest.raises(IndexError):
        y[np.ones(3, bool)]


def stopped_after(model, data, n: int, out: Path) -> None:
    """A collect run whose inputs fail after the first n (the shards finished by then stay, with their manifest)."""

    def failing():
        yield from data[:n]
        raise RuntimeError("the data set failed")

    with pytest.raises(RuntimeError, match="the data set failed"):
        research.collect(model, failing(), ["y.1"], out, batch_size=2, shard_mb=0.01)


def run_child(out: Path, log: Path, kill_after: float | None = None) -> tuple[bool, float]:
    """collect_child.py into out, killed (SIGKILL) kill_after seconds after it is ready, or run to its end: whether
    it finished, and how long it ran after it was ready."""
    with log.open("a") as stderr:
        child = subprocess.Popen(
            [sys.executable, str(CHILD), str(out)], stdout=subprocess.PIPE, stderr=stderr, text=True
        )
        try:
            assert child.stdout.readline() == "ready\n", log.read_text()[-3000:]
            start = time.monotonic()
            try:
                child.wait(timeout=TIMEOUT if kill_after is None else kill_after)
            except subprocess.TimeoutExpired:
                assert kill_after is not None, f"the child ran past {TIMEOUT} s"
                child.kill()
                child.wait()
                return False, time.monotonic() - start
            assert child.returncode == 0, log.read_text()[-3000:]
            return True, time.monotonic() - start
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict[str, np.ndarray], float]:
    """The child's store run once without a kill, and how long a run takes once its executables are compiled (a
    second run: the kills fall inside that time)."""
    folder = tmp_path_factory.mktemp("whole")
    assert run_child(folder / "store", folder / "stderr.txt")[0]
    finished, took = run_child(folder / "again", folder / "stderr.txt")
    assert finished
    return read_all(research.ActivationStore(folder / "store")), took


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_run_killed_at_random_moments_resumes_without_losing_or_repeating_a_row(seed, uninterrupted, tmp_path):
    """The child is killed at random moments (often inside a shard's write or the manifest's) and started again
    until it finishes (a run that ends before its first kill is thrown away and redone, killed sooner): after
    every kill the store opens and holds a prefix of the uninterrupted run's rows (no unreadable shard, no row
    lost or repeated); in the end it equals that run's store bit for bit."""
    whole, took = uninterrupted
    rng = np.random.default_rng(seed)
    out, log, kills = tmp_path / "store", tmp_path / "stderr.txt", 0
    for _ in range(20):
        finished, _ = run_child(out, log, kill_after=float(rng.uniform(0.02, 0.5)) * took)
        if finished and kills == 0:  # `took` was measured on a busier machine: start again, killing sooner
            shutil.rmtree(out)
            took /= 2
            continue
        if finished:
            break
        kills += 1
        if (out / MANIFEST).exists():
            now = read_all(research.ActivationStore(out))
            n = len(now["input"])
            for k in whole:
                np.testing.assert_array_equal(now[k], whole[k][:n], f"{k} after kill {kills}")
    else:
        finished, _ = run_child(out, log)
    assert kills >= 1
    resumed = read_all(research.ActivationStore(out))
    for k in whole:
        np.testing.assert_array_equal(resumed[k], whole[k], k)


@pytest.mark.slow
def test_the_default_model_s_stored_rows_are_its_activations_alone(model, tmp_path):
    """The stored (Q4_1, native products where they run) default model: rows of texts of mixed lengths in batches
    of 2 equal Model.activations of each text alone, bit for bit, at a middle layer, a TransformerLens hook and
    the final norm (the layers run only as far as asked, the head only for nf)."""

    texts = [PROMPTS[0], "Hi", PROMPTS[2]]
    store = research.collect(model, texts, ["y.6", "blocks.3.hook_resid_post", "nf"], tmp_path / "s", batch_size=2)
    got = read_all(store)
    for i, text in enumerate(texts):
        acts = model.activations(model.tokenizer.encode(text), keep=("y",))
        rows = got["input"] == i
        np.testing.assert_array_equal(got["y.6"][rows], acts["y"][6])
        np.testing.assert_array_equal(got["blocks.3.hook_resid_post"][rows], acts["y"][3])
        np.testing.assert_array_equal(got["nf"][rows], acts["nf"])


@pytest.mark.slow
def test_the_collect_command_stores_a_jsonl_file_and_resumes_it(tmp_path):
    """`llama-jax collect FILE --sites ... --out DIR` stores texts and ids lines and prints a summary; run again on
    the finished store it adds nothing; a bad line or site is one line on stderr and exit status 2."""
    lines = [{"text": "The capital of France is Paris."}, {"ids": [1, 2, 3, 4]}]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = [sys.executable, "-m", "llama_jax.cli", "collect", str(data), "--sites", "y.2", "--out"]
    for _ in range(2):
        done = subprocess.run([*command, str(tmp_path / "s")], capture_output=True, text=True, timeout=TIMEOUT)
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        assert summary["sites"] == ["y.2"] and summary["rows"] == summary["tokens"] > 4
    data.write_text('{"text": "fine"}\n{"txt": "a typo"}\n')
    done = subprocess.run([*command, str(tmp_path / "bad")], capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0 and "data.jsonl:2" in done.stderr
    bad_site = [*command[:6], "pattern.2", "--out", str(tmp_path / "bad2")]
    done = subprocess.run(bad_site, capture_output=True, text=True, timeout=TIMEOUT)
    assert done.returncode == 2 and "attention pattern" in done.stderr


def test_a_bad_run_is_refused_before_anything_is_written(tiny, tmp_path):
    """Every bad argument is an InvalidArgumentError (or the check's own error) naming what was wrong, and leaves no
    store behind."""
    from llama_jax.errors import CapacityError, InvalidArgumentError, TokenIdError

    good = [[1, 2, 3]]
    cases = [
        ({"sites": ["pattern.0"]}, InvalidArgumentError, "attention pattern"),
        ({"sites": ["y.2"]}, InvalidArgumentError, "layer 2 of a model of 2 layers"),
        ({"sites": ["resid"]}, InvalidArgumentError, "no site named 'resid'"),
        ({"sites": ["y", "y.1"]}, InvalidArgumentError, r"\['y.1'\] are asked for more than once"),
        ({"sites": []}, InvalidArgumentError, "sites takes site names"),
        ({"dtype": "int8"}, InvalidArgumentError, "the store keeps float32"),
        ({"batch_size": 0}, InvalidArgumentError, "batch_size must be a positive integer"),
        ({"positions": "first"}, InvalidArgumentError, "'all', 'last', or one boolean mask"),
        ({"shard_mb": 0.0}, InvalidArgumentError, "shard_mb must be a positive number"),
    ]
    for change, error, message in cases:
        settings = {"sites": ["y.1"]} | change
        with pytest.raises(error, match=message):
            research.collect(tiny, good, settings.pop("sites"), tmp_path / "s", **settings)
    assert not (tmp_path / "s").exists()
    inputs_cases = [
        ([[1, 2], []], {}, InvalidArgumentError, "input 1: expected a non-empty"),
        ([[1, 2], [999]], {}, TokenIdError, "input 1: token id 999"),
        ([list(range(200))], {}, CapacityError, "input 0: 200 tokens exceed the model's context of 128"),
        ([[1, 2], [3]], {"positions": [np.ones(2, bool)]}, InvalidArgumentError, "fewer masks than there are inputs"),
        ([[1, 2]], {"positions": [np.ones(3, bool)]}, InvalidArgumentError, "input 0: its mask must be booleans of"),
    ]
    for i, (data, settings, error, message) in enumerate(inputs_cases):
        with pytest.raises(error, match=message):
            research.collect(tiny, data, ["y.1"], tmp_path / f"bad{i}", **settings)
    with pytest.raises(ActivationStoreError, match=r"no manifest\.json; not an activation store"):
        research.ActivationStore(tmp_path / "nothing")
