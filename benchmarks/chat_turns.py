"""Time to first token over the turns of a chat, `llama-jax serve` with its prompt cache and without: a chat whose
history reaches ~1,500 tokens by its fourth turn (a long document, then questions about it), each turn re-sending
the whole history, as a chat client does.

    taskset -c 0,1 .venv/bin/python benchmarks/chat_turns.py [--turns 4] [--max-tokens 64]

Each server runs alone (one after the other), greedy; each runs the chat twice over two documents of about the same
length (the first run compiles the shapes, the second is timed). Per turn: the prompt's tokens, the time to the first
streamed token with the cache and without, their ratio; and whether every answer and every token's log-probability
is the same with the cache as without (the cache's claim: the same bits).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from serve_load import free_port, start

SENTENCES = [
    "The river rose slowly through the night, and by morning the lower fields of the valley were under water.",
    "Farmers moved their animals to the hills, where the old stone barns still stood above the flood line.",
    "The village council met in the school, the only building on high ground with room for everyone.",
    "They decided to open the grain store and share what was left of last year's harvest.",
    "Boats came from the town downstream, bringing bread, blankets and a doctor who stayed for a week.",
    "When the water fell, the fields were covered in a thin layer of grey mud that dried and cracked in the sun.",
    "The next spring the harvest was the best anyone could remember, and the council built a wall along the river.",
]
QUESTIONS = ["Summarize the story in two sentences.", "Who helped the village?", "What happened to the fields?",
             "What did the council build?", "Give the story a title.", "What is the moral?"]  # fmt: skip


def document(seed: int, sentences: int) -> str:
    order = [(seed + 3 * i) % len(SENTENCES) for i in range(sentences)]
    return " ".join(SENTENCES[i] for i in order)


def turn(url: str, messages: list[dict], max_tokens: int) -> tuple[float, str, list[float]]:
    """One streamed greedy chat turn: its time to the first token, its text and its tokens' log-probabilities."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "logprobs": True}  # fmt: skip
    start_time, first, text, logprobs = time.perf_counter(), None, [], []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"]
            if not choice or choice[0].get("finish_reason") is not None:
                continue
            tokens = (choice[0].get("logprobs") or {}).get("content") or []
            if tokens:  # (the first chunk holds the role only, sent before the prompt is prefilled)
                first = first or time.perf_counter()
            text.append(choice[0]["delta"].get("content") or "")
            logprobs += [entry["logprob"] for entry in tokens]
    return first - start_time, "".join(text), logprobs


def chat(url: str, doc: str, turns: int, max_tokens: int) -> list[dict]:
    messages = [{"role": "user", "content": f"{doc}\n\n{QUESTIONS[0]}"}]
    rows = []
    for k in range(turns):
        tokens = httpx.post(f"{url}/tokenize", json={"messages": messages}, timeout=60).json()["count"]
        ttft, text, logprobs = turn(url, messages, max_tokens)
        rows.append({"tokens": tokens, "ttft_s": ttft, "text": text, "logprobs": logprobs})
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": QUESTIONS[k + 1]}]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--sentences", type=int, default=61, help="the document's (61: ~1,300 tokens)")
    args = parser.parse_args()
    from run import cpu_name

    import llama_jax

    gguf = llama_jax.default_model_path()
    results = {}
    for name, megabytes in [("with the prompt cache", "1024"), ("without", "0")]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "llama_jax.cli", "serve", "--model", str(gguf), "--model-name", "m",
                   "--port", str(port), "--prompt-cache-mb", megabytes]  # fmt: skip
        process = start(command, url, Path(f"/tmp/chat_turns_{port}.log"))
        try:
            chat(url, document(1, args.sentences), args.turns, args.max_tokens)  # compiles the shapes
            results[name] = chat(url, document(2, args.sentences), args.turns, args.max_tokens)
            results[name + " health"] = httpx.get(f"{url}/health").json()
        finally:
            process.terminate()
            process.wait(timeout=120)
    cached, fresh = results["with the prompt cache"], results["without"]
    print(f"CPU: {cpu_name()}; a chat of {args.turns} turns, {args.max_tokens} new tokens each, greedy")
    print("| turn | prompt tokens | first token, cached (ms) | fresh (ms) | fresh / cached | same bits |")
    print("|---|---|---|---|---|---|")
    for k, (c, f) in enumerate(zip(cached, fresh, strict=True)):
        same = c["text"] == f["text"] and c["logprobs"] == f["logprobs"]
        print(f"| {k + 1} | {c['tokens']} | {c['ttft_s'] * 1e3:.0f} | {f['ttft_s'] * 1e3:.0f} |"
              f" {f['ttft_s'] / c['ttft_s']:.2f} | {same} |")  # fmt: skip
    print(f"prompt cache after both chats: {results['with the prompt cache health']['prompt_cache']}")


if __name__ == "__main__":
    main()
