"""Across devices: on 8 forced host CPU devices, data-parallel scoring and sharded-weight generation give the
single-device results (log-probs within 1e-4, the same tokens). Run in a fresh process: the device count is
fixed when JAX starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llama_jax import ShardingError, make_mesh

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs() -> dict:
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    script = Path(__file__).with_name("sharded_run.py")
    out = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=script.parent.parent,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout)


@pytest.mark.parametrize("mesh", ["data2-model4", "model8", "data8"])
def test_sharded_scoring_and_generation_equal_one_device(runs, mesh):
    single, sharded = runs["single"], runs[mesh]
    for a, b in zip(single["logprobs"], sharded["logprobs"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    assert sharded["greedy"] == single["greedy"]


def test_seeded_sampling_on_a_data_and_model_mesh_draws_the_one_device_tokens(runs):
    assert runs["data2-model4"]["sampled"] == runs["single"]["sampled"]


def test_the_mlp_is_split_over_the_model_axis(runs):
    assert runs["data2-model4-down-spec"] == "P(None, None, 'model', None)"  # [L, D, ffn / 32 blocks, bytes]
    assert runs["data8-down-spec"] == "P(None, None, 'model', None)"  # a model axis of 1


def test_a_model_whose_heads_divide_shards_attention_and_cache_too(runs):
    tiny = runs["tiny"]
    assert tiny["q_spec"] == "P(None, 'model', None)"
    assert tiny["sharded"] == tiny["single"]
    np.testing.assert_allclose(tiny["logits_sharded"], tiny["logits_single"], rtol=1e-4, atol=1e-4)


def test_a_mesh_the_devices_cannot_form_is_refused():
    with pytest.raises(ShardingError, match="needs 4 devices"):
        make_mesh(data=4, model=1)
    with pytest.raises(ShardingError, match="does not divide"):
        make_mesh(model=3, devices=[object(), object()])
