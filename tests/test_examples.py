"""The picture examples (examples/attention_pattern.py, logit_lens.py, attribution_patching.py, sae.py) write their PNG,
and the numbers behind each picture are the model's: the pattern is the stored attention probabilities, the logit
lens's last layer ranks the next tokens exactly as the model's own logits do, the patching grids obey the laws of
a patch, and the sparse autoencoder learns its stored activations."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")
pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run_example(name: str, tmp_path: Path, *args: str) -> tuple[dict, np.ndarray]:
    """Runs an example with --json in tmp_path: its numbers and its image ([height, width, channels])."""
    import matplotlib.image

    out = tmp_path / f"{name}.png"
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), *args, "--out", str(out), "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(done.stdout.strip().splitlines()[-1]), matplotlib.image.imread(out)


def test_the_attention_pattern_picture_shows_the_stored_pattern(tmp_path, model):
    prompt = "The cat sat on the mat because the cat was tired."
    numbers, image = run_example("attention_pattern", tmp_path, prompt, "--layer", "3", "--head", "7")
    assert image.shape[0] > 200 and image.shape[1] > 200
    ids = model.tokenizer.encode(prompt)
    pattern = np.array(numbers["pattern"])  # [query, key]
    expected = model.activations(ids, keep=("pattern",))["pattern"][3, 7]
    np.testing.assert_array_equal(pattern, expected)
    np.testing.assert_allclose(pattern.sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.triu(pattern, 1) == 0)  # causal: no query sees a later key
    assert numbers["tokens"] == [model.tokenizer.decode([i]) for i in ids]


def test_the_logit_lens_picture_ends_in_the_models_own_ranking(tmp_path, model):
    text = "The capital of France is Paris, and the capital of Italy is Rome."
    numbers, image = run_example("logit_lens", tmp_path, text)
    assert image.shape[0] > 200 and image.shape[1] > 200
    ids = model.tokenizer.encode(text)
    ranks = np.array(numbers["ranks"])  # [layers, T-1]
    assert ranks.shape == (model.config.layers, len(ids) - 1)
    logits = model.logits(ids)[:-1]  # [T-1, V]
    chosen = logits[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_array_equal(ranks[-1], (logits > chosen[:, None]).sum(-1))
    top = logits.max(-1, keepdims=True)
    logprobs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))  # [T-1, V]
    np.testing.assert_allclose(np.array(numbers["logprobs"])[-1], logprobs[np.arange(len(ids) - 1), ids[1:]], atol=1e-4)


def test_the_attribution_patching_picture_shows_exact_effects_and_their_estimates(tmp_path):
    """Both grids are [layers, positions]; the exact one obeys patching's laws (no effect before the country, whose
    tokens the two prompts share; the last layer's stream at the last position carries the clean metric whole)
    and the estimates follow it (Pearson r > 0.9)."""
    numbers, image = run_example("attribution_patching", tmp_path)
    assert image.shape[0] > 200 and image.shape[1] > 200
    exact, estimate = np.array(numbers["exact"]), np.array(numbers["estimate"])
    assert exact.shape == estimate.shape == (30, len(numbers["tokens"]))
    country = numbers["tokens"].index(" Italy")
    np.testing.assert_allclose(exact[:, :country], 0.0, atol=1e-4)
    np.testing.assert_allclose(exact[-1, -1], numbers["clean"] - numbers["corrupt"], rtol=1e-5)
    assert np.corrcoef(exact.ravel(), estimate.ravel())[0, 1] > 0.9


def test_the_sparse_autoencoder_example_trains_on_the_stored_activations(tmp_path, model):
    """examples/sae.py collects y.6 of its texts (every token of each, cut to 128) and trains: the variance left
    unexplained falls as it trains, and L0 stays a small part of the dictionary."""
    numbers, image = run_example("sae", tmp_path, "--texts", "24", "--steps", "200")
    assert image.shape[0] > 200 and image.shape[1] > 200
    assert numbers["features"] == 4 * model.config.dim
    assert numbers["fvu"][-1] < 0.5 * numbers["fvu"][0] and numbers["fvu"][-1] < 0.5
    assert 0 < numbers["l0"][-1] < 0.1 * numbers["features"]
