"""Process start to first token: imports, loads and generates one token from a 16-token prompt, then prints the
token and its peak RSS. run.py times it from the spawn of this process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engines import peak_rss_mb
from worker import make

engine = make(sys.argv[1], sys.argv[2])
ids = json.loads(sys.argv[3])
token = int(engine.first_logits(ids).argmax())
print(json.dumps({"token": token, "peak_rss_mb": peak_rss_mb()}))
