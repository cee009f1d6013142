"""The `llama-jax` command, run as a subprocess: generate (argument, stdin, --json, --stop), chat, info, convert,
and the user errors (exit status 2, one line on stderr, no traceback, nothing on stdout).

Every run of a subcommand other than convert loads the real SmolLM2-135M-Instruct weights in a fresh process (a few
seconds each), so the runs are few and generate at most 16 new tokens.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import llama_jax

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "llama_jax.cli"]
PROMPT = "The capital of France is"
N = 12  # new tokens of the generate runs
SAMPLING = {"temperature": 0.8, "top_k": 40, "seed": 7}
SAMPLING_ARGS = ["--temperature", "0.8", "--top-k", "40", "--seed", "7"]


def run_cli(*args: object, stdin: str | bytes = "") -> subprocess.CompletedProcess:
    """`python -m llama_jax.cli ARGS` with stdin (empty by default, never the terminal's), outputs as text."""
    cmd = [*CLI, *map(str, args)]
    if isinstance(stdin, bytes):  # input that is not text: the outputs are still decoded as UTF-8
        done = subprocess.run(cmd, input=stdin, capture_output=True, timeout=300)
        return subprocess.CompletedProcess(
            done.args, done.returncode, done.stdout.decode("utf-8", "replace"), done.stderr.decode("utf-8", "replace")
        )
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=300)


def run_cli_side_by_side(*runs: tuple) -> list[subprocess.CompletedProcess]:
    """run_cli of each tuple of arguments, as many processes at once as there are cores (each spends most of its
    time starting Python and JAX on one core)."""
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return list(pool.map(lambda args: run_cli(*args), runs))


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, f"exit {done.returncode}\nstdout: {done.stdout}\nstderr: {done.stderr}"
    assert "Traceback" not in done.stderr
    return done


def assert_user_error(done: subprocess.CompletedProcess, *expect: str) -> str:
    """Exit 2, exactly one non-empty line on stderr (naming each of expect), no traceback, nothing on stdout."""
    report = f"exit {done.returncode}\nstdout: {done.stdout!r}\nstderr: {done.stderr[-3000:]}"
    assert "Traceback" not in done.stdout + done.stderr, report
    assert done.returncode == 2, report
    assert done.stdout == "", report
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), report
    assert lines[0].startswith("llama-jax"), report
    for text in expect:
        assert text in lines[0], report
    return lines[0]


# ---- the console script ----


def test_console_script_help():
    """The `llama-jax` console script is installed beside the interpreter, and `--help` exits 0 naming the four
    subcommands."""
    script = Path(sys.executable).parent / "llama-jax"
    assert script.is_file(), f"{script} is missing"
    done = ok(subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=300))
    for command in ("generate", "chat", "convert", "info"):
        assert command in done.stdout


# ---- generate ----


def test_generate_argument_equals_in_process(model):
    """`generate PROMPT` (greedy) prints exactly model.generate(PROMPT) and one final newline."""
    expected = model.generate(PROMPT, max_new_tokens=N)
    assert expected  # a non-empty continuation, or the comparison says little
    done = ok(run_cli("generate", "--max-new-tokens", N, PROMPT))
    assert done.stdout == expected + "\n"


def test_generate_reads_stdin(model):
    """`generate` without a prompt argument reads the prompt from standard input (all of it, as is) and prints the
    same as with the argument."""
    done = ok(run_cli("generate", "--max-new-tokens", N, stdin=PROMPT))
    assert done.stdout == model.generate(PROMPT, max_new_tokens=N) + "\n"


def test_generate_json_sampling_equals_in_process_and_reproduces(model):
    """`generate --json` with sampling prints one JSON object whose ids are model.generate_ids and whose text is
    model.generate under the same settings; a second fresh process prints the very same (the seeded sampler keeps
    no state between processes)."""
    args = ("generate", "--json", "--max-new-tokens", N, *SAMPLING_ARGS, PROMPT)
    first, second = map(ok, run_cli_side_by_side(args, args))
    assert first.stdout == second.stdout
    assert first.stdout.count("\n") == 1 and first.stdout.endswith("\n")
    out = json.loads(first.stdout)
    assert set(out) == {"prompt", "ids", "text"}
    assert out["prompt"] == PROMPT
    assert out["ids"] == model.generate_ids(model.tokenizer.encode(PROMPT), max_new_tokens=N, **SAMPLING)
    assert out["text"] == model.generate(PROMPT, max_new_tokens=N, **SAMPLING)
    assert out["text"] != model.generate(PROMPT, max_new_tokens=N)  # the settings reached the sampler


def test_generate_stop(model):
    """`generate --stop S` ends the text just before the first S of the continuation (S itself not printed)."""
    full = model.generate(PROMPT, max_new_tokens=N)
    words = full.split()
    stop = words[len(words) // 2]  # a word in the middle of the greedy continuation
    cut = full.index(stop)
    assert cut > 0, f"{stop!r} begins the continuation {full!r}"
    done = ok(run_cli("generate", "--max-new-tokens", N, "--stop", stop, PROMPT))
    assert done.stdout == full[:cut] + "\n"
    assert done.stdout[:-1] == model.generate(PROMPT, max_new_tokens=N, stop=stop)


# ---- chat ----


def test_chat_two_turns_from_stdin(model):
    """`chat` reads one user turn per line: two lines give two answer lines, the second answered with the first
    turn and its answer in the history (equal to model.generate of the chat prompt), and input after /exit is
    not read."""
    questions = ["What is the capital of France?", "And what is the capital of Germany?"]
    stdin = "\n".join([*questions, "/exit", "What is 2 + 2?"]) + "\n"
    done = ok(run_cli("chat", "--max-new-tokens", 16, stdin=stdin))
    messages, answers = [], []
    for question in questions:
        messages.append({"role": "user", "content": question})
        answer = model.generate(model.chat_prompt(messages), max_new_tokens=16)
        messages.append({"role": "assistant", "content": answer})
        answers.append(answer)
    assert "Paris" in answers[0]
    assert all("\n" not in a for a in answers)  # one line each, so stdout has exactly two lines
    assert done.stdout == "".join(a + "\n" for a in answers)
    assert done.stderr == ""  # not a terminal: no prompt marks


# ---- info ----


def info_rows(stdout: str) -> dict[str, str]:
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in stdout.splitlines() if line.strip())
    return rows


def mib(value: str) -> float:
    number, unit = value.split()
    assert unit == "MiB"
    return float(number)


DTYPES = ("float32", "stored", "bfloat16")


def test_info_stored_float32_and_bfloat16():
    """`info` reports the default model: 134,515,008 parameters, 30 layers, vocab 49152, held as stored where the
    native kernels run (Q4_1 matrices, the Q8_0 embedding: the file's 96.6 MB); with --dtype float32 all f32,
    with bfloat16 half of that."""
    f32, stored, bf16 = (
        info_rows(ok(done).stdout) for done in run_cli_side_by_side(*(("info", "--dtype", d) for d in DTYPES))
    )
    assert f32["parameters"] == "134,515,008"
    assert f32["layers"] == "30"
    assert f32["vocab"] == "49152"
    assert f32["weights"] == "float32 (272 arrays, 538.1 MB)"
    assert mib(f32["weights memory"]) == pytest.approx(134_515_008 * 4 / 2**20, abs=0.1)
    assert stored["weights"] == "Q4_1 (210 arrays, 66.4 MB), Q8_0 (1 array, 30.1 MB), float32 (61 arrays, 0.1 MB)"
    assert mib(stored["weights memory"]) == pytest.approx(96.6e6 / 2**20, abs=0.1)
    assert bf16["weights"].startswith("bfloat16 (272 arrays")
    assert bf16["parameters"] == "134,515,008"
    assert mib(bf16["weights memory"]) == pytest.approx(mib(f32["weights memory"]) / 2, abs=0.1)


# ---- convert ----


def test_convert_then_generate_then_refuse(default_path, tmp_path):
    """`convert GGUF DIR --dtype bfloat16` writes a Hugging Face checkpoint that `generate --model DIR` runs (the
    same text as the in-process model of DIR); converting into DIR again without --overwrite is a user error
    that leaves the files alone."""
    out = tmp_path / "smollm2-bf16"
    done = ok(run_cli("convert", default_path, out, "--dtype", "bfloat16"))
    assert str(out) in done.stdout
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"

    done = ok(run_cli("generate", "--model", out, "--dtype", "bfloat16", "--max-new-tokens", 8, PROMPT))
    expected = llama_jax.load(out, dtype="bfloat16").generate(PROMPT, max_new_tokens=8)
    assert done.stdout == expected + "\n"

    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert_user_error(run_cli("convert", default_path, out, "--dtype", "bfloat16"), str(out), "overwrite")
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp


# ---- user errors ----


def corrupt_gguf(tmp: Path) -> Path:
    data = random.Random(0).randbytes(100)
    assert not data.startswith(b"GGUF")
    (tmp / "x.gguf").write_bytes(data)
    return tmp / "x.gguf"


def empty_dir(tmp: Path) -> Path:
    (tmp / "empty").mkdir()
    return tmp / "empty"


def a_file(tmp: Path) -> Path:
    (tmp / "afile").write_text("not a directory\n")
    return tmp / "afile"


# (args, built from tmp_path and the default model's path; stdin; texts the one line must hold)
ERRORS = [
    pytest.param(lambda t, d: ["generate", "--model", t / "missing", PROMPT], "", ["missing"], id="missing-model"),
    pytest.param(lambda t, d: ["generate", "--model", empty_dir(t), PROMPT], "", ["config.json"], id="no-config"),
    pytest.param(lambda t, d: ["generate", "--model", corrupt_gguf(t), PROMPT], "", ["x.gguf"], id="corrupt-gguf"),
    pytest.param(lambda t, d: ["generate", "--top-p", "2", PROMPT], "", ["top_p"], id="top-p-2"),
    pytest.param(lambda t, d: ["generate", "--temperature", "-1", PROMPT], "", ["temperature"], id="temperature-neg"),
    pytest.param(lambda t, d: ["generate", "--max-new-tokens", "abc", PROMPT], "", ["abc"], id="max-new-tokens-abc"),
    pytest.param(lambda t, d: ["bogus"], "", ["bogus"], id="unknown-subcommand"),
    pytest.param(lambda t, d: ["convert", t / "missing.gguf", t / "out"], "", ["missing.gguf"], id="convert-missing"),
    # "hello " * 9000 is 9001 tokens of SmolLM2's tokenizer; the default context is 8192
    pytest.param(lambda t, d: ["generate"], "hello " * 9000, ["9001", "8192"], id="prompt-past-context"),
    pytest.param(lambda t, d: ["generate", "--seed", "-1", PROMPT], "", ["-1"], id="seed-neg"),
    pytest.param(
        lambda t, d: ["generate", "--json-schema", '{"type": "foo"}', PROMPT],
        "",
        ["Invalid type: foo"],
        id="schema-bad",
    ),
    pytest.param(
        lambda t, d: ["generate", "--grammar-file", t / "no.gbnf", PROMPT], "", ["no.gbnf"], id="grammar-missing"
    ),
    pytest.param(
        lambda t, d: ["convert", d, a_file(t)],
        "",
        ["afile", "not a directory"],
        id="convert-into-a-file",
    ),
    pytest.param(
        lambda t, d: ["generate"],
        b"caf\xe9 au lait",
        ["UTF-8"],
        id="stdin-not-utf8",
    ),
]


@pytest.fixture(scope="module")
def user_errors(tmp_path_factory, default_path) -> dict[str, subprocess.CompletedProcess]:
    """The runs of ERRORS by id, side by side as run_cli_side_by_side runs them, each in a folder of its own."""
    runs = {e.id: (e.values[0](tmp_path_factory.mktemp(e.id), default_path), e.values[1]) for e in ERRORS}
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        return dict(zip(runs, pool.map(lambda run: run_cli(*run[0], stdin=run[1]), runs.values()), strict=True))


@pytest.mark.parametrize("case", [pytest.param(case, id=case.id) for case in ERRORS])
def test_user_error(case, user_errors):
    """A user error (a bad checkpoint path or file, a bad option, an unknown subcommand, a prompt past the context,
    bad input) exits with status 2 after exactly one line on stderr that says what was wrong, with no traceback and
    nothing on stdout."""
    assert_user_error(user_errors[case.id], *case.values[2])
