"""The lm-evaluation-harness model: the real harness runs local tasks (multiple choice, rolling perplexity, and
generation with stop sequences) with llama-jax on the default GGUF file and with lm-eval's own `hf` backend on
that file converted to a Hugging Face directory (as a user compares them), and the two answer every request
alike: log-likelihoods within 1e-4 per scored token, the same is_greedy, the same accuracy, the same greedy
generations."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from llama_jax import convert_gguf

pytest.importorskip("lm_eval")
pytestmark = pytest.mark.slow

MAX_LENGTH = 128  # both backends: the 300-token document runs as several rolling windows
MC = [
    {"question": "What color is the sky on a clear day?", "choices": ["blue", "green", "red", "black"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten", "four"], "answer": 1},
    {"question": "Which animal says moo?", "choices": ["dog", "cat", "cow", "duck"], "answer": 2},
    {"question": "What is frozen water called?", "choices": ["steam", "ice", "fog", "rain"], "answer": 1},
]
PPL = [
    {"text": "The quick brown fox jumps over the lazy dog."},
    {"text": "Once upon a time, in a land far away, there lived a king who had three daughters. " * 12},
]
GEN = [
    {"question": "The capital of France is", "answer": "Paris"},
    {"question": "Question: What is 2 + 2?\nAnswer:", "answer": "4"},
    {"question": "The three primary colors are", "answer": "red"},
]
TASKS = {
    "lj_mc": (
        MC,
        """output_type: multiple_choice
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: answer
metric_list:
  - {metric: acc, aggregation: mean, higher_is_better: true}""",
    ),
    "lj_ppl": (
        PPL,
        """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - {metric: word_perplexity, aggregation: weighted_perplexity, higher_is_better: false}""",
    ),
    "lj_gen": (
        GEN,
        """output_type: generate_until
doc_to_text: "{{question}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: [".", "\\n"]
  max_gen_toks: 24
  do_sample: false
metric_list:
  - {metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true}""",
    ),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, default_path):
    root = tmp_path_factory.mktemp("lm_eval")
    for name, (rows, body) in TASKS.items():
        data = root / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (root / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
            f"test_split: test\n{body}\nmetadata: {{version: 1.0}}\n"
        )
    return root, default_path, convert_gguf(default_path, root / "smollm2")


def evaluate(model: str, model_args: str, tasks_dir) -> tuple[dict, float]:
    """simple_evaluate in a fresh process (offline), its samples and results as JSON, and its wall time."""
    code = f"""
import json, sys
import llama_jax.lm_eval
from lm_eval import simple_evaluate
from lm_eval.tasks import TaskManager
r = simple_evaluate(model={model!r}, model_args={model_args!r}, tasks={list(TASKS)!r}, batch_size=4, device="cpu",
                    task_manager=TaskManager(include_path={str(tasks_dir)!r}, include_defaults=False),
                    log_samples=True, bootstrap_iters=0)
out = {{"results": r["results"], "samples": {{t: [{{"doc_id": s["doc_id"], "arguments": s["arguments"],
        "resps": s["filtered_resps"]}} for s in r["samples"][t]] for t in r["samples"]}}}}
print(json.dumps(out, default=str))
"""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["HF_DATASETS_CACHE"] = str(tasks_dir / "datasets")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), time.perf_counter() - start


def test_llama_jax_answers_every_request_as_the_hf_backend(setup):
    """llama-jax reads the GGUF file, hf the converted directory: the rolling windows' first tokens are scored
    after the same prefix (BOS, which the directory keeps), so every request agrees."""
    tasks_dir, gguf_path, converted = setup
    mine, my_time = evaluate("llama-jax", f"path={gguf_path},max_length={MAX_LENGTH}", tasks_dir)
    ref, ref_time = evaluate("hf", f"pretrained={converted},dtype=float32,max_length={MAX_LENGTH}", tasks_dir)
    print(f"\nsimple_evaluate wall time, 3 tasks: llama-jax {my_time:.1f} s, hf {ref_time:.1f} s")
    tokenizer = __import__("llama_jax").load(converted).tokenizer
    worst = 0.0  # the largest difference per scored token of any log-likelihood
    for task in TASKS:
        rows = sorted(mine["samples"][task], key=lambda s: s["doc_id"])
        refs = sorted(ref["samples"][task], key=lambda s: s["doc_id"])
        assert len(rows) == len(refs) == len(TASKS[task][0])
        for row, expected in zip(rows, refs, strict=True):
            assert row["arguments"] == expected["arguments"]
            for args, got, want in zip(row["arguments"], row["resps"], expected["resps"], strict=True):
                if task == "lj_gen":
                    assert got == want, (args, got, want)
                    continue
                text = "".join(a for a in args if isinstance(a, str))
                tokens = len(tokenizer.encode(text))  # at least the scored tokens
                if task == "lj_mc":
                    (got_ll, got_greedy), (want_ll, want_greedy) = got, want
                    assert got_greedy == want_greedy, args
                else:
                    got_ll, want_ll = float(got), float(want)
                assert math.isclose(float(got_ll), float(want_ll), rel_tol=0, abs_tol=1e-4 * tokens), (args, got, want)
                worst = max(worst, abs(float(got_ll) - float(want_ll)) / tokens)
        metrics = {k: v for k, v in ref["results"][task].items() if "," in k and isinstance(v, float)}
        assert metrics and {k: mine["results"][task][k] for k in metrics} == pytest.approx(metrics, rel=1e-4), task
    print(f"largest log-likelihood difference per token: {worst:.2e}")
    gen = sorted(mine["samples"]["lj_gen"], key=lambda s: s["doc_id"])
    assert gen[0]["resps"][0].strip() == "Paris"  # cut at the stop sequence "."


def test_the_eval_command_runs_lm_eval_with_llama_jax(setup, tmp_path):
    """`llama-jax eval` takes lm-eval's own flags (the CLI's strings: batch_size "4", device "cpu"), chooses the
    llama-jax model, and writes lm-eval's results file."""
    tasks_dir, _, converted = setup
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path)}
    args = ["--tasks", "lj_mc", "--include_path", str(tasks_dir), "--limit", "2", "--batch_size", "4"]
    args += ["--model_args", f"path={converted},max_length={MAX_LENGTH}", "--device", "cpu"]
    args += ["--output_path", str(tmp_path / "out")]
    done = subprocess.run(
        [sys.executable, "-m", "llama_jax.cli", "eval", *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    data = json.loads(results.read_text())
    assert data["config"]["model"] == "llama-jax"
    assert data["results"]["lj_mc"]["acc,none"] in (0.0, 0.5, 1.0)


def test_without_the_extra_the_command_says_how_to_install_it():
    """lm-eval missing (its import blocked): one line on stderr naming the install command, exit status 2."""
    code = "import sys; sys.modules['lm_eval'] = None; from llama_jax.cli import main; sys.exit(main(['eval']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("llama-jax: error: llama_jax.lm_eval needs lm-evaluation-harness")
    assert line.endswith("install it with: pip install 'llama-jax[eval]'")


def test_sampled_generation_is_the_seeded_sampler_of_generate(model):
    """generate_until with do_sample: request k's text is what `Model.generate` draws for its prompt with seed + k
    (the spec's sampler; each sequence as alone, so the batch size changes nothing), cut at the stop sequence;
    the same requests again give the same texts."""
    from lm_eval.api.instance import Instance
    from lm_eval.api.registry import get_model

    import llama_jax.lm_eval  # noqa: F401 (registers the model)

    lm = get_model("llama-jax").create_from_arg_string("batch_size=2,seed=11,max_gen_toks=16")
    kwargs = {"until": ["\n\n"], "do_sample": True, "temperature": 0.9, "top_p": 0.95, "max_gen_toks": 12}
    prompts = ["Once upon a time", "The best way to learn a language is", "def fib(n):"]
    requests = [Instance("generate_until", {}, (p, dict(kwargs)), i) for i, p in enumerate(prompts)]
    texts = lm.generate_until(requests)
    assert texts == lm.generate_until(requests)
    for b, (prompt, text) in enumerate(zip(prompts, texts, strict=True)):
        alone = model.generate(prompt, max_new_tokens=12, temperature=0.9, top_p=0.95, seed=11 + b, stop="\n\n")
        assert text == alone, (prompt, text, alone)


def test_a_pair_is_cut_where_the_hf_backend_cuts_it(model):
    """_encode_pair: the context's own tokens, and the tokens of context + continuation after as many; where the
    whole merges across the seam, the context keeps its own tokens (as lm-eval's TemplateLM._encode_pair); the
    context's trailing spaces move to the continuation; an empty context is the prefix token."""
    import llama_jax.lm_eval

    lm = llama_jax.lm_eval.LlamaJaxLM(batch_size=1)
    encode = model.tokenizer.encode
    context, continuation = "The answer is (", "'a')"
    ctx, cont = lm._encode_pair(context, continuation)
    assert ctx == encode(context) and cont == encode(context + continuation)[len(ctx) :]
    assert encode(context + continuation)[: len(ctx)] != ctx  # the seam merges here: the case that matters
    assert lm._encode_pair("Answer: ", "Paris") == (
        encode("Answer:"),
        encode("Answer: Paris")[len(encode("Answer:")) :],
    )
    assert lm._encode_pair("", " Paris") == ([lm.prefix_token_id], encode(" Paris"))
