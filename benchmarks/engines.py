"""The engines the benchmark compares, each behind the same four tasks, timed inside the engine's own process.

- decode(batch): a 16-token prompt per sequence, 128 new tokens, greedy; the seconds from the first new token
  to the last (prefill excluded).
- prefill: one 512-token prompt, up to the logits of its last position.
- score: 8 sequences of 256 tokens, the log-probability of every token (every logit computed).
- first_token: a 16-token prompt to its first new token (used by the start-up runs).

Threads are pinned to THREADS for every engine (torch.set_num_threads, llama.cpp's n_threads; XLA's CPU client
uses one thread per core, and the runner pins every worker to the same cores).
"""

from __future__ import annotations

import re
import resource
import time
from pathlib import Path

import numpy as np

THREADS = 2
NEW_TOKENS = 128


def peak_rss_mb() -> float:
    """This process's peak resident memory, MB: VmHWM, which starts afresh at exec (getrusage's ru_maxrss keeps
    the maximum of the process that forked this one, so a large parent would set a floor under every figure)."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) / 1024


def log_softmax_gather(logits: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """log p of each next token from [T, V] logits (float32, as the scoring runs of llama-jax compute it)."""
    shifted = logits[:-1] - logits[:-1].max(-1, keepdims=True)
    logz = np.log(np.exp(shifted).sum(-1))
    return shifted[np.arange(len(ids) - 1), ids[1:]] - logz


class LlamaJax:
    def __init__(self, dtype: str):
        import llama_jax

        self.llama_jax = llama_jax
        self.model = llama_jax.load(dtype=dtype)

    def decode(self, prompts: list[list[int]]) -> float:
        from llama_jax.generate import token_steps

        steps = token_steps(self.model.weights, self.model.config, prompts, NEW_TOKENS)
        next(steps)
        start = time.perf_counter()
        for _ in steps:
            pass
        return time.perf_counter() - start

    def prefill(self, ids: list[int]) -> float:
        start = time.perf_counter()
        self.first_logits(ids)
        return time.perf_counter() - start

    def first_logits(self, ids: list[int]) -> np.ndarray:
        m = self.model
        cache = self.llama_jax.KVCache.empty(m.config, 1, 1024)
        logits, _ = self.llama_jax.prefill(m.weights, cache, np.array([ids], np.int32), m.config)
        return np.asarray(logits[0])

    def score(self, batch: list[list[int]]) -> float:
        start = time.perf_counter()
        self.model.score(batch, batch_size=len(batch), progress=False)
        return time.perf_counter() - start


class Transformers:
    def __init__(self, directory: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(THREADS)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype)).eval()

    def _generate(self, prompts: list[list[int]], n: int):
        x = self.torch.tensor(prompts)
        with self.torch.no_grad():
            return self.model.generate(
                x,
                attention_mask=self.torch.ones_like(x),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    def decode(self, prompts: list[list[int]]) -> float:
        start = time.perf_counter()
        self._generate(prompts, 1)
        first = time.perf_counter() - start
        start = time.perf_counter()
        self._generate(prompts, NEW_TOKENS)
        return time.perf_counter() - start - first

    def prefill(self, ids: list[int]) -> float:
        start = time.perf_counter()
        with self.torch.no_grad():
            self.model(self.torch.tensor([ids]), logits_to_keep=1)
        return time.perf_counter() - start

    def first_logits(self, ids: list[int]) -> np.ndarray:
        with self.torch.no_grad():
            return self.model(self.torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float().numpy()

    def score(self, batch: list[list[int]]) -> float:
        start = time.perf_counter()
        x = self.torch.tensor(batch)
        with self.torch.no_grad():
            logits = self.model(x).logits.float()
            logprobs = self.torch.log_softmax(logits[:, :-1], -1).gather(-1, x[:, 1:, None])
        logprobs.numpy()
        return time.perf_counter() - start


class LlamaCpp:
    """llama.cpp through llama-cpp-python: one context for generation, one with every position's logits."""

    def __init__(self, path: str):
        from llama_cpp import Llama

        self.path = path
        self.llm = Llama(
            model_path=path, n_ctx=1024, n_batch=512, n_threads=THREADS, n_threads_batch=THREADS, verbose=False
        )
        self.scorer = None

    def _last_logits(self) -> np.ndarray:
        """The logits after the last evaluated token (llama-cpp-python's `scores` stays zero without logits_all)."""
        import llama_cpp

        pointer = llama_cpp.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self.llm.n_vocab(),)).copy()

    def _greedy(self, prompt: list[int], n: int) -> float:
        llm = self.llm
        llm.reset()
        llm.eval(prompt)
        token = int(np.argmax(self._last_logits()))
        start = time.perf_counter()
        for _ in range(n - 1):
            llm.eval([token])
            token = int(np.argmax(self._last_logits()))
        return time.perf_counter() - start

    def decode(self, prompts: list[list[int]]) -> float:
        return sum(self._greedy(p, NEW_TOKENS) for p in prompts)  # no batched generation in llama-cpp-python

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(ids)
        return time.perf_counter() - start

    def first_logits(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        return self._last_logits()

    def score(self, batch: list[list[int]]) -> float:
        if self.scorer is None:
            from llama_cpp import Llama

            self.scorer = Llama(
                model_path=self.path,
                n_ctx=1024,
                n_batch=512,
                n_threads=THREADS,
                n_threads_batch=THREADS,
                logits_all=True,
                verbose=False,
            )
        start = time.perf_counter()
        for ids in batch:
            self.scorer.reset()
            self.scorer.eval(ids)
            log_softmax_gather(np.asarray(self.scorer.scores[: len(ids)]), np.array(ids))
        return time.perf_counter() - start
