"""The engines the benchmark compares, each behind the same four tasks, timed inside the engine's own process.

- decode(batch): a 16-token prompt per sequence, 128 new tokens, greedy; the seconds from the first new token
  to the last (prefill excluded).
- prefill: one 512-token prompt, up to the logits of its last position.
- score: 8 sequences of 256 tokens, the log-probability of every token (every logit computed).
- first_token: a 16-token prompt to its first new token (used by the start-up runs).
- logits: the logits after the last position of a prompt (the fidelity row: against transformers F32's).

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
    def __init__(self, dtype: str, path: str | None = None):
        """path: a GGUF file; None: the default model, as llama_jax.load(dtype=...) loads it (the call a baseline
        tree's load takes too). dtype "bfloat16-tier": bf16 weights in the bfloat16 compute tier."""
        import llama_jax

        self.llama_jax = llama_jax
        tier = {"dtype": "bfloat16", "precision": "bfloat16"} if dtype == "bfloat16-tier" else {"dtype": dtype}
        self.model = llama_jax.load(**tier) if path is None else llama_jax.load(path, **tier)

    def decode(self, prompts: list[list[int]]) -> float:
        try:
            from llama_jax.passes.generate import token_steps
        except ImportError:  # a baseline tree from before the package was grouped by job
            from llama_jax.generate import token_steps

        m = self.model
        steps = token_steps(m.weights, m.config, prompts, NEW_TOKENS, native=m.native.active)
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
        ids = np.array([ids], np.int32)
        logits, _ = self.llama_jax.prefill(m.weights, cache, ids, m.config, native=m.native.active)
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
    """llama.cpp driven as its own tools drive it, through llama-cpp-python's low-level API: a whole prompt (or a
    whole scoring batch, the sequences side by side) in one llama_decode, batched generation with one token per
    sequence per llama_decode, and greedy draws by its C sampler, not a Python loop over logits."""

    N_CTX = 4096  # room for the scoring batch: 8 sequences of 256 positions side by side, and prompt + 128
    N_BATCH = 2048

    def __init__(self, path: str):
        import llama_cpp as L

        self.L = L
        self.quiet = L.llama_log_callback(lambda level, text, data: None)  # kept: llama.cpp holds the pointer
        L.llama_log_set(self.quiet, None)
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        params = L.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = self.N_CTX, self.N_BATCH, 512, 8
        params.n_threads = params.n_threads_batch = THREADS
        self.ctx = L.llama_init_from_model(self.model, params)
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.batch = L.llama_batch_init(self.N_BATCH, 0, 8)
        self.sampler = L.llama_sampler_init_greedy()

    def _decode(self, tokens: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(tokens)
        if self.L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def _prompts(self, prompts: list[list[int]]) -> list[int]:
        """Every prompt in one llama_decode, logits after each one's last token; returns those tokens' places in
        the batch (the index llama_get_logits_ith and the sampler take)."""
        self._clear()
        entries = [(t, i, b, i == len(p) - 1) for b, p in enumerate(prompts) for i, t in enumerate(p)]
        self._decode(entries)
        return [i for i, entry in enumerate(entries) if entry[3]]

    def decode(self, prompts: list[list[int]]) -> float:
        lasts = self._prompts(prompts)
        tokens = [self.L.llama_sampler_sample(self.sampler, self.ctx, i) for i in lasts]
        start = time.perf_counter()
        for step in range(NEW_TOKENS - 1):
            self._decode([(t, len(p) + step, b, True) for b, (t, p) in enumerate(zip(tokens, prompts, strict=True))])
            tokens = [self.L.llama_sampler_sample(self.sampler, self.ctx, b) for b in range(len(prompts))]
        return time.perf_counter() - start

    def prefill(self, ids: list[int]) -> float:
        start = time.perf_counter()
        self.first_logits(ids)
        return time.perf_counter() - start

    def first_logits(self, ids: list[int]) -> np.ndarray:
        self._prompts([ids])
        pointer = self.L.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy()

    def score(self, batch: list[list[int]]) -> float:
        start = time.perf_counter()
        self._clear()
        self._decode([(t, i, b, True) for b, ids in enumerate(batch) for i, t in enumerate(ids)])
        logits = np.ctypeslib.as_array(self.L.llama_get_logits(self.ctx), shape=(sum(map(len, batch)), self.n_vocab))
        at = 0
        for ids in batch:
            log_softmax_gather(logits[at : at + len(ids)], np.array(ids))
            at += len(ids)
        return time.perf_counter() - start
