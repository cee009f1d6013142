"""A collect run that tests/test_store.py kills at random moments and runs again: a tiny random model over a fixed
data set of random token ids, in small shards (many writes, so a kill often lands inside one). Prints "ready" once
the model is loaded, just before the run starts, then "done" when it has finished.

    python tests/collect_child.py OUT_DIR
"""

from __future__ import annotations

import sys

import numpy as np

from llama_jax import research
from llama_jax.testing import tiny_config, tiny_model

INPUTS = 120
SITES = ("y.1", "blocks.0.attn.hook_q", "embeds")
SHARD_MB = 0.004  # 10 rows a shard (392 bytes a row)
BATCH = 3


def data_set() -> list[list[int]]:
    """INPUTS sequences of 1 to 40 random byte ids (fixed)."""
    rng = np.random.default_rng(7)
    return [rng.integers(0, 256, int(rng.integers(1, 41))).tolist() for _ in range(INPUTS)]


def model():
    return tiny_model(tiny_config(layers=2))


if __name__ == "__main__":
    m = model()
    print("ready", flush=True)
    research.collect(m, data_set(), SITES, sys.argv[1], batch_size=BATCH, shard_mb=SHARD_MB, progress=False)
    print("done", flush=True)
