"""`python -m llama_jax.demo [PROMPT]`: the default model continues a prompt (greedy), and says how fast."""

from __future__ import annotations

import sys
import time

from llama_jax.errors import LlamaJaxError
from llama_jax.model import load

PROMPT = "The three primary colors are"


def main(argv: list[str]) -> int:
    prompt = " ".join(argv) or PROMPT
    try:
        start = time.perf_counter()
        model = load()
        print(f"{model} loaded in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        start = time.perf_counter()
        text = model.generate(prompt, max_new_tokens=48)
    except LlamaJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(prompt + text)
    print(f"(48 new tokens at most, greedy, in {time.perf_counter() - start:.1f} s with compilation)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
