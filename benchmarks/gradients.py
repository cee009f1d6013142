"""Gradients of a next-token loss over 256 tokens, llama-jax beside PyTorch autograd (transformers), on the same F32
weights (the default model dequantized), in one process, 2 threads, each warmed up first, rounds alternating:

- weight gradients: llama-jax `research.weight_grads`, each written into the last one's memory (`reuse`, as a
  loop of gradients would call it), against `loss.backward()` with every parameter trainable (`zero_grad()` before:
  PyTorch's default, new gradient tensors each call);
- activation gradients: llama-jax `research.activation_grads` with names=("y",) (every layer's output and its
  gradient: the same work) and with every site of every layer (15 a layer, the pattern included: more work) against
  autograd to the input embeddings with every layer's output retained (`retain_grad`), the parameters frozen.

    taskset -c 0,1 .venv/bin/python benchmarks/gradients.py [--rounds 3] [--keep-freed-memory]

--keep-freed-memory runs the process (both engines) with the allocator keeping what it frees: on a VM each call's
fresh pages otherwise cost llama-jax's gradients (XLA allocates its large buffers afresh every call) seconds of
system time at worst.

Prints seconds per gradient (median, min-max) and the ratios (PyTorch time / llama-jax time: above 1, llama-jax is
faster), and the largest difference of the weight gradients (q_proj of layer 0) as a check that both compute the
same thing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from run import token_ids  # noqa: E402

import llama_jax  # noqa: E402
from llama_jax import research  # noqa: E402
from llama_jax.runtime import memory  # noqa: E402

T = 256


def next_token_loss(logits):  # mean cross-entropy of each position's next token, ids fixed below
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits[:-1]), IDS[1:, None], axis=-1))


IDS = np.asarray(token_ids(T), np.int32)  # NumPy: importing this runs no JAX computation (see --keep-freed-memory)


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--keep-freed-memory",
        action="store_true",
        help="the process's allocator keeps what it frees (llama_jax.runtime.memory.keep_freed_memory), both engines",
    )
    args = parser.parse_args()
    if args.keep_freed_memory:
        print(f"keep_freed_memory: {memory.keep_freed_memory()}")
    torch.set_num_threads(2)
    from transformers import LlamaForCausalLM

    converted = Path(tempfile.gettempdir()) / "llama-jax-smollm2-f32"
    if not (converted / "config.json").exists():
        llama_jax.convert_gguf(llama_jax.default_model_path(), converted, overwrite=True)
    model = llama_jax.load(converted)  # the same F32 weights as transformers reads
    hf = LlamaForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    ids = [int(i) for i in IDS]
    labels = torch.tensor([ids])

    held = {"grads": None}  # each weight gradient written into the last one's memory (weight_grads' reuse)

    def jax_weights():
        held["grads"] = jax.block_until_ready(research.weight_grads(model, ids, next_token_loss, held["grads"]))

    def jax_residual():
        research.activation_grads(model, ids, next_token_loss, names=("y",))

    def jax_every_site():
        research.activation_grads(model, ids, next_token_loss)

    def torch_weights():
        hf.zero_grad(set_to_none=True)
        hf(torch.tensor([ids]), labels=labels).loss.backward()

    def torch_activations():
        for p in hf.parameters():
            p.requires_grad_(False)
        embeds = hf.model.embed_tokens(torch.tensor([ids])).detach().requires_grad_(True)
        out = hf(inputs_embeds=embeds, labels=labels, output_hidden_states=True)
        for h in out.hidden_states:
            h.retain_grad()
        out.loss.backward()
        for p in hf.parameters():
            p.requires_grad_(True)

    runs = {
        "jax weights": jax_weights,
        "torch weights": torch_weights,
        "jax activations": jax_residual,
        "jax activations (every site)": jax_every_site,
        "torch activations": torch_activations,
    }
    held["grads"] = research.weight_grads(model, ids, next_token_loss)  # the warm-up's round then reuses it
    check = np.asarray(held["grads"].layers.q[0])
    torch_weights()
    difference = np.abs(check - hf.model.layers[0].self_attn.q_proj.weight.grad.numpy()).max()
    print(f"llama-jax: {model.native}; max |d q_proj(0)| difference from PyTorch: {difference:.2e}")
    for fn in runs.values():
        time.sleep(1)
        fn()  # warm, a whole round untimed: compiles, and each engine's memory taken beside the other's
    times = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            time.sleep(1)  # the other engine's threads idle first (OpenMP's and XLA's spin a while after work)
            times[name].append(seconds(fn))
    for name, values in times.items():
        print(f"{name}: {statistics.median(values):.3f} s ({min(values):.3f}-{max(values):.3f})")
    pairs = (("weights", "weights"), ("activations", "activations"), ("activations", "activations (every site)"))
    for kind, ours in pairs:
        ratios = [t / j for t, j in zip(times[f"torch {kind}"], times[f"jax {ours}"], strict=True)]
        print(f"{ours} gradients, PyTorch / llama-jax per round: {', '.join(f'{r:.2f}' for r in ratios)}")


if __name__ == "__main__":
    main()
