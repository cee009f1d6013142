"""Process start to first token: imports, loads and generates one token from a 16-token prompt, then prints the
token and its peak RSS. run.py times it from the spawn of this process. Engine "jax": JAX's own footprint alone
(the import, its CPU client and one tiny computation), the floor under llama-jax's figure."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engines import peak_rss_mb

if sys.argv[1] == "jax":
    import jax.numpy as jnp

    token = int(jnp.ones(1, jnp.int32).sum())
else:
    from worker import make

    token = int(make(sys.argv[1], sys.argv[2]).first_logits(json.loads(sys.argv[3])).argmax())
print(json.dumps({"token": token, "peak_rss_mb": peak_rss_mb()}))
