"""The README's examples run, and print what the README says they print, so the two cannot drift apart.

- ```pycon blocks: doctests, run in order in one namespace (a later block uses what an earlier one made), in a
  child process with 8 host devices (the sharding example builds a mesh over them).
- ```console blocks: each `$ command` runs in bash with the package's commands on PATH, in a scratch directory
  holding `examples/` and `model.gguf` (the default model); what follows it, up to the next `$`, is its output.
Both compare as doctest does, with ELLIPSIS (`...` stands for any text) and NORMALIZE_WHITESPACE.
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)

pytestmark = pytest.mark.slow


def blocks(language: str) -> list[tuple[int, str]]:
    """The README's fenced blocks of one language, with the line each starts on."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(2)) for m in BLOCK.finditer(text) if m.group(1) == language]


def run_pycon() -> int:
    """Runs every pycon block as one doctest; returns the number of failures (the report goes to stdout)."""
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(optionflags=FLAGS)
    namespace: dict = {}
    for line, text in blocks("pycon"):
        test = parser.get_doctest(text, namespace, f"README.md:{line}", str(README), line - 1)
        runner.run(test, clear_globs=False)
        namespace = test.globs  # the test ran in a copy: the next block goes on from what this one made
    return runner.summarize(verbose=False).failed


def test_the_python_examples_print_what_the_readme_shows():
    assert blocks("pycon"), "no pycon blocks in the README"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=1500, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-3000:]


def console_examples() -> list[tuple[int, str, str]]:
    """(line, command, expected output) of every `$ ` line of the console blocks."""
    examples = []
    for start, text in blocks("console"):
        lines = text.splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
        for k, i in enumerate(starts):
            end = starts[k + 1] if k + 1 < len(starts) else len(lines)
            examples.append((start + i, lines[i][2:], "\n".join(lines[i + 1 : end])))
    return examples


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, default_path) -> Path:
    directory = tmp_path_factory.mktemp("readme")
    (directory / "examples").symlink_to(ROOT / "examples")
    (directory / "model.gguf").symlink_to(default_path)
    return directory


@pytest.mark.parametrize(("line", "command", "want"), console_examples(), ids=lambda v: str(v)[:40])
def test_each_console_example_prints_what_the_readme_shows(scratch, line, command, want):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=900, env=env, cwd=scratch)
    assert done.returncode == 0, f"README.md:{line}: {command}\n{done.stderr[-3000:]}"
    checker, example = doctest.OutputChecker(), doctest.Example(command, want + "\n")
    assert checker.check_output(example.want, done.stdout, FLAGS), (
        f"README.md:{line}: {command}\n" + checker.output_difference(example, done.stdout, FLAGS)
    )


if __name__ == "__main__":
    sys.exit(1 if run_pycon() else 0)
