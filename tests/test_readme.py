"""The README's and the manual's (docs/*.md) examples run, and print what the pages say they print, so the two
cannot drift apart; and every relative link of those pages leads somewhere.

- ```pycon blocks: doctests, run in order in one namespace per page (a later block uses what an earlier one made;
  each page sets up what it uses), all pages in one child process with 8 host devices (the sharding example builds
  a mesh over them). `python tests/test_readme.py docs/research.md` runs one page's.
- ```console blocks: each `$ command` runs in bash with the package's commands on PATH, in a scratch directory
  holding `examples/` and `model.gguf` (the default model); what follows it, up to the next `$`, is its output.
Both compare as doctest does, with ELLIPSIS (`...` stands for any text) and NORMALIZE_WHITESPACE.
- ```python blocks, which show no output (the pages with one: the server's and the evaluation's): each runs as
  written, and what it makes is held to what the page says of it. The server's client example runs against
  `llama-jax serve` started as the page starts it (the default model under its file's name, on 127.0.0.1; a free
  port in place of 8000) and prints the model's own greedy completion and log-probabilities; the evaluation
  page's, from the repository's root, gets the accuracy that page's command line prints.
"""

from __future__ import annotations

import ast
import contextlib
import doctest
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import llama_jax

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
FENCED = re.compile(r"^```.*?^```$", re.MULTILINE | re.DOTALL)  # any fenced block, with a language or without
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def blocks(page: Path, language: str) -> list[tuple[int, str]]:
    """A page's fenced blocks of one language, with the line each starts on."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(2)) for m in BLOCK.finditer(text) if m.group(1) == language]


def run_pycon(pages: list[Path]) -> int:
    """Runs each page's pycon blocks as one doctest in a namespace of its own; returns the number of failures (the
    report goes to stdout)."""
    parser, runner = doctest.DocTestParser(), doctest.DocTestRunner(optionflags=FLAGS)
    for page in pages:
        namespace: dict = {}
        for line, text in blocks(page, "pycon"):
            test = parser.get_doctest(text, namespace, f"{name(page)}:{line}", str(page), line - 1)
            runner.run(test, clear_globs=False)
            namespace = test.globs  # the test ran in a copy: the next block goes on from what this one made
    return runner.summarize(verbose=False).failed


@pytest.mark.slow
def test_the_python_examples_print_what_the_pages_show():
    assert blocks(PAGES[0], "pycon"), "no pycon blocks in the README"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=1500, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-3000:]


def console_examples() -> list[tuple[str, str, str]]:
    """(page:line, command, expected output) of every `$ ` line of every page's console blocks."""
    examples = []
    for page in PAGES:
        for start, text in blocks(page, "console"):
            lines = text.splitlines()
            starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
            for k, i in enumerate(starts):
                end = starts[k + 1] if k + 1 < len(starts) else len(lines)
                examples.append((f"{name(page)}:{start + i}", lines[i][2:], "\n".join(lines[i + 1 : end])))
    return examples


@pytest.fixture(scope="module")
def scratch(tmp_path_factory, default_path) -> Path:
    directory = tmp_path_factory.mktemp("readme")
    (directory / "examples").symlink_to(ROOT / "examples")
    (directory / "model.gguf").symlink_to(default_path)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize(("where", "command", "want"), console_examples(), ids=lambda v: str(v)[:40])
def test_each_console_example_prints_what_the_page_shows(scratch, where, command, want):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=900, env=env, cwd=scratch)
    assert done.returncode == 0, f"{where}: {command}\n{done.stderr[-3000:]}"
    checker, example = doctest.OutputChecker(), doctest.Example(command, want + "\n")
    difference = checker.output_difference(example, done.stdout, FLAGS)
    assert checker.check_output(example.want, done.stdout, FLAGS), f"{where}: {command}\n{difference}"


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, as GitHub (and mkdocs) make them: lower case, punctuation dropped, spaces
    to hyphens."""
    headings = re.findall(r"^#+ (.+)$", FENCED.sub("", page.read_text()), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_every_relative_link_leads_to_a_file_and_heading():
    broken = []
    for page in PAGES:
        for target in LINK.findall(FENCED.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
                broken.append(f"{name(page)}: {target}")
    assert not broken, "links that lead nowhere:\n" + "\n".join(broken)


def test_every_python_block_is_one_these_tests_run():
    """A page that gains a ```python block gains a test here (a block with no output to compare needs its own)."""
    pages = {name(page) for page in PAGES if blocks(page, "python")}
    assert pages == {"docs/serving.md", "docs/evaluation.md"}, pages


@pytest.mark.slow
def test_the_server_page_s_client_example_prints_the_model_s_completion(model, tmp_path):
    """docs/serving.md's Python (the `openai` client) against `llama-jax serve` with the default model, as the page
    starts it: it prints Model.complete's greedy text of 8 tokens and those tokens' log-probabilities, which are
    Model.score's of them after the prompt (within 1e-4); then the structured output's JSON, Model.chat's with the
    same schema; then two embeddings' count and width, and a text's ids and the text they give back; then the prompt
    cache's hits over a chat's three turns, as the page says."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    from tests.served import Served

    examples = blocks(ROOT / "docs" / "serving.md", "python")
    assert len(examples) == 4 and all("http://127.0.0.1:8000/v1" in code for _, code in examples)
    served = Served(tmp_path, name=None)  # the model's id: its file's name, as the example asks for it
    outputs = []
    try:
        for line, code in examples:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(compile(code.replace(":8000/", f":{served.port}/"), f"docs/serving.md:{line}", "exec"), {})
            outputs.append(printed.getvalue())
    finally:
        assert served.stop(), served.log.read_text()[-3000:]
    ids = model.tokenizer.encode("The capital of France", add_special=False)
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    assert outputs[1] == model.chat(messages, grammar=llama_jax.Grammar.json_schema(person)) + "\n"
    assert outputs[3] == "3\n"
    assert outputs[2] == f"2 {model.config.dim}\n{ids} The capital of France\n"  # the embeddings and tokenizer's
    text, _, logprobs = outputs[0].removesuffix("\n").rpartition(" [")
    prompt = "The capital of France is"
    expected = model.complete(prompt, max_new_tokens=8)
    assert text == expected.text
    scored = model.score([(model.tokenizer.encode(prompt), expected.ids)])[0].logprobs
    np.testing.assert_allclose(ast.literal_eval("[" + logprobs), scored, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_the_evaluation_page_s_python_gets_the_accuracy_its_command_line_prints(tmp_path):
    """docs/evaluation.md's Python (lm_eval.simple_evaluate with the llama-jax model on the local task), run from
    the repository's root, offline: its result's accuracy is the one in the table the page's `llama-jax eval`
    prints."""
    pytest.importorskip("lm_eval")
    page = ROOT / "docs" / "evaluation.md"
    ((line, code),) = blocks(page, "python")
    (acc,) = re.findall(r"^\|capitals\|.*?\|acc\s*\|\S*\s*\|\s*([\d.]+)\|", page.read_text(), re.MULTILINE)
    program = ast.parse(code)
    *_, last = program.body
    assert isinstance(last, ast.Expr), "the block ends in the simple_evaluate call"
    program.body[-1] = ast.parse(f"result = {ast.unparse(last.value)}").body[0]
    program.body += ast.parse('print(result["results"]["capitals"]["acc,none"])').body
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path)}
    run = [sys.executable, "-c", ast.unparse(program)]
    done = subprocess.run(run, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert done.returncode == 0, f"docs/evaluation.md:{line}\n{done.stderr[-3000:]}"
    assert float(done.stdout.strip().splitlines()[-1]) == float(acc)


if __name__ == "__main__":
    chosen = [ROOT / arg for arg in sys.argv[1:]] or PAGES
    sys.exit(1 if run_pycon(chosen) else 0)
