"""Run in a fresh process with 8 host CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8, set by
tests/test_sharding.py): the same work single-device and sharded, printed as JSON for the test to compare."""

from __future__ import annotations

import json

import jax
import numpy as np

import llama_jax
from llama_jax.core.sharding import weight_specs
from llama_jax.loaders.checkpoint import Checkpoint
from llama_jax.testing import byte_tokenizer, random_weights, tiny_config

TEXTS = [
    "The capital of France is Paris.",
    "Water boils at 100 degrees Celsius.",
    "def add(a, b):\n    return a + b",
    "Once upon a time, in a small village by the sea,",
    "1 2 3 4 5",
    "Hi there",
    "Photosynthesis converts light into chemical energy.",
    "The quick brown fox jumps over the lazy dog.",
]
PROMPTS = ["The capital of France is", "Once upon a time,", "def fibonacci(n):"]


def run(model: llama_jax.Model, sample: bool) -> dict:
    """Scores and greedy continuations; with sample, a seeded sampled one too (a program of its own to compile:
    on the mixed mesh only)."""
    scores = model.score(TEXTS, batch_size=8)
    out = {"logprobs": [s.logprobs.tolist() for s in scores], "greedy": model.generate(PROMPTS, max_new_tokens=6)}
    if sample:
        out["sampled"] = model.generate(PROMPTS[1], max_new_tokens=6, temperature=0.8, top_k=50, seed=3)
    return out


def main() -> None:
    assert len(jax.devices()) == 8, jax.devices()
    out = {}
    model = llama_jax.load()
    out["single"] = run(model, sample=True)
    # SmolLM2-135M: 9 heads do not split over 4 or 8 devices (attention replicated); its MLP (1536) does
    for name, mesh in {
        "data2-model4": llama_jax.make_mesh(data=2, model=4),
        "model8": llama_jax.make_mesh(model=8),
        "data8": llama_jax.make_mesh(data=8),
    }.items():
        sharded = model.shard(mesh)
        out[name] = run(sharded, sample=name == "data2-model4")
        out[name + "-down-spec"] = str(sharded.weights.layers.down.blocks.sharding.spec)  # Q4_1 blocks
    # a random model whose heads split over 4 devices: attention, MLP and the cache all sharded
    config = tiny_config(kv=4, g=2, half=4, ffn=32, layers=2)
    tiny = llama_jax.Model(Checkpoint(config, random_weights(config, 3), byte_tokenizer(), None, (256,), "tiny"))
    mesh = llama_jax.make_mesh(data=2, model=4)
    assert weight_specs(config, mesh).layers.q == jax.sharding.PartitionSpec(None, "model", None)
    ids = [[5, 17, 200, 3, 99], [8, 1, 77], [2, 2, 9, 250, 4, 4, 4], [100, 101]]
    tiny_sharded = tiny.shard(mesh)
    out["tiny"] = {
        "single": [tiny.generate_ids(i, max_new_tokens=10) for i in ids],
        "sharded": [tiny_sharded.generate_ids(i, max_new_tokens=10) for i in ids],
        "logits_single": np.asarray(tiny.logits(ids[0])).tolist(),
        "logits_sharded": np.asarray(tiny_sharded.logits(ids[0])).tolist(),
        "q_spec": str(tiny_sharded.weights.layers.q.sharding.spec),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
