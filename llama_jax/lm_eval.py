"""An lm-evaluation-harness model: importing this module registers llama-jax with lm-eval as "llama-jax".

    import llama_jax.lm_eval, lm_eval
    lm_eval.simple_evaluate(model="llama-jax", model_args="path=model.gguf,batch_size=8", tasks=["hellaswag"])

or `llama-jax eval --tasks ... [lm-eval's own flags]`. The requests are cut into tokens exactly as lm-eval's `hf`
backend cuts them, so the two give the same requests the same numbers (tests/test_lm_eval.py):
- loglikelihood(context, continuation): trailing whitespace of the context moves to the continuation; the
  continuation's tokens are those of context+continuation after the context's (an empty context is the prefix
  token: BOS, else EOS); context+continuation is cut from the left to max_length+1 tokens; scored by the jitted
  batch scoring (`Model.score`: sorted by length, one compile per length bucket), one forward pass for all the
  requests with the same input (as the hf backend's cache does: a question's one-token answers); is_greedy:
  every continuation token is its position's argmax.
- loglikelihood_rolling(text): lm-eval's disjoint rolling windows of max_length tokens (the first after the
  prefix token), every token scored once, the windows of all texts scored together.
- generate_until(context, gen_kwargs): lm-eval's reading of gen_kwargs (until, max_gen_toks, do_sample,
  temperature; the EOS text joins the stop strings), the context cut from the left to max_length - max_gen_toks
  tokens, batched generation (each sequence's tokens as alone: greedy, or the spec's seeded sampler), the text
  decoded without special tokens and cut at the first stop string.
lm-eval is an optional dependency: `pip install 'llama-jax[eval]'`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from llama_jax.errors import InvalidArgumentError, MissingExtraError
from llama_jax.passes.sampling import Sampling, consecutive_seeds

try:
    import lm_eval.models  # noqa: F401 (lm-eval's own models first: it fills its registry only when that is empty)
    from lm_eval.__main__ import cli_evaluate  # noqa: F401 (lm-eval's command line, for `llama-jax eval`)
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
except ImportError as e:  # pragma: no cover (the extra is installed wherever the tests run)
    raise MissingExtraError(
        f"llama_jax.lm_eval needs lm-evaluation-harness ({e}); install it with: pip install 'llama-jax[eval]'"
    ) from e

from llama_jax.model import load

DEFAULT_BATCH = 8


@register_model("llama-jax")
class LlamaJaxLM(LM):
    """llama-jax as an lm-eval model. model_args: path (a checkpoint; default the default model), dtype and
    precision (the compute tier; both as `llama_jax.load`), batch_size (sequences per jitted batch; "auto" means the
    default, 8; a batch_size in model_args wins over lm-eval's --batch_size), max_length (tokens a request may see;
    default the model's context, as lm-eval's hf backend), max_gen_toks (default 256, as the hf backend), seed
    (request k of a sampling task draws with seed + k). device is accepted and ignored: JAX runs on its default
    device."""

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> LlamaJaxLM:
        """lm-eval's constructor from model_args plus its own settings (batch_size, device, ...): the model_args
        win where both name a setting (lm-eval's CLI always passes its own batch_size)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> LlamaJaxLM:
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def __init__(
        self,
        path: str | None = None,
        dtype: str | None = None,
        batch_size: int | str = DEFAULT_BATCH,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        seed: int = 0,
        device: str | None = None,
        max_batch_size: int | None = None,
        precision: str = "float32",
    ):
        super().__init__()
        self.model = load(path, dtype=dtype, precision=precision)
        self.batch_size = _batch_size(batch_size)
        self.max_length = self.model.config.context if max_length is None else int(max_length)
        if not 1 <= self.max_length <= self.model.config.context:
            raise InvalidArgumentError(
                f"max_length={max_length} must lie in 1..{self.model.config.context} (the model's context); leave it"
                " out for the context"
            )
        self.max_gen_toks = int(max_gen_toks)
        self.seed = int(seed)
        if not self.model.eos_ids:
            raise InvalidArgumentError(
                f"{path or 'the default model'}: the checkpoint names no end-of-sequence token, which lm-eval needs"
                " (as the end of a generation and the prefix of an empty context); add eos_token_id to its config"
            )
        self.eot_token_id = self.model.eos_ids[0]
        self.prefix_token_id = self.model.bos_id if self.model.bos_id is not None else self.eot_token_id

    # ---- tokens, as lm-eval's hf backend cuts them ----

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        encode = self.model.tokenizer.encode
        if not context:
            cont = encode(continuation)
            return ([self.prefix_token_id], cont) if cont[0] != self.prefix_token_id else (cont[:1], cont[1:])
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, ctx = encode(context + continuation), encode(context)
        return ctx, whole[len(ctx) :]  # the context's own tokens, even where the whole merges across the seam

    def _loglikelihoods(
        self, pairs: Sequence[tuple[list[int], list[int]]], progress: bool | None = None
    ) -> list[tuple[float, bool]]:
        """Each (context, continuation) of ids, cut from the left to max_length + 1 tokens: the continuation's
        summed log-probability and whether every token of it is the argmax. As lm-eval's hf backend does, the
        requests whose model input (all but the last token) is the same share one forward pass (the choices of a
        multiple-choice question with one-token answers): its tokens' log-probabilities, and the whole vocabulary's
        after its end for each request's last token. Inputs run in batches sorted by length (`Model.score`), each
        scored only at the tail its requests read (its last `needed` tokens: a (context, continuation) item)."""
        inputs: dict[tuple[int, ...], int] = {}  # model input -> its index among the inputs scored
        needed: list[int] = []  # per input: how many of its last tokens a request reads (at least 1)
        requests = []
        for ctx, cont in pairs:
            if not cont or len(cont) > self.max_length:
                raise InvalidArgumentError(
                    f"a continuation of {len(cont)} tokens (after the context's, of context + continuation); lm-eval"
                    f" scores 1 to max_length={self.max_length}: check the task's continuation, or raise max_length"
                )
            ids = (ctx + cont)[-(self.max_length + 1) :]
            k = inputs.setdefault(tuple(ids[:-1]), len(inputs))
            if k == len(needed):
                needed.append(1)
            needed[k] = max(needed[k], len(cont) - 1)
            requests.append((k, cont))
        # the input's tail as a continuation; the context keeps a token (an input holds len(cont) tokens or more), and
        # an input of one token is scored as ids (nothing but what follows it)
        items = [
            (list(ids[:-n]), list(ids[-n:])) if len(ids) > n else list(ids)
            for ids, n in zip(inputs, needed, strict=True)
        ]
        scores = self.model.score(items, batch_size=self.batch_size, progress=progress, with_next=True)
        out = []
        for k, cont in requests:
            s, shared = scores[k], len(cont) - 1  # the input's last `shared` tokens are the continuation's first
            logprob = float(s.logprobs[s.logprobs.size - shared :].astype(np.float64).sum()) + float(s.next[cont[-1]])
            greedy = bool(s.is_argmax[s.is_argmax.size - shared :].all()) and int(np.argmax(s.next)) == cont[-1]
            out.append((logprob, greedy))
        return out

    # ---- lm-eval's three requests ----

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._loglikelihoods([self._encode_pair(*r.args) for r in requests], _progress(disable_tqdm))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for k, request in enumerate(requests):
            (text,) = request.args
            tokens = self.model.tokenizer.encode(text)
            for window in get_rolling_token_windows(tokens, self.prefix_token_id, self.max_length, 1):
                windows.append(make_disjoint_window(window))
                owner.append(k)
        totals = [0.0] * len(requests)
        for k, (logprob, _) in zip(owner, self._loglikelihoods(windows, _progress(disable_tqdm)), strict=True):
            totals[k] += logprob
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[str, list[int]] = {}
        for k, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(k)
        eos = self.model.tokenizer.decode([self.eot_token_id])
        seeds = consecutive_seeds(self.seed, len(requests), "request")  # request k draws with seed + k, in any batch
        out: list[str] = [""] * len(requests)
        for members in groups.values():
            settings = normalize_gen_kwargs(dict(requests[members[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(settings.pop("until", None), eos=eos)
            new = int(settings.pop("max_gen_toks"))
            if new >= self.max_length:
                raise InvalidArgumentError(
                    f"max_gen_toks={new} leaves no room for a context in max_length={self.max_length}: lower"
                    " max_gen_toks (gen_kwargs) or raise max_length (model_args)"
                )
            sampling = _sampling(settings, until)
            contexts = [self.model.tokenizer.encode(requests[k].args[0])[-(self.max_length - new) :] for k in members]
            for start in range(0, len(members), self.batch_size):
                batch = slice(start, start + self.batch_size)
                seeded = dataclasses.replace(sampling, seed=[seeds[k] for k in members[batch]])
                ids = self.model.generate_ids(contexts[batch], new, sampling=seeded)
                for k, generated in zip(members[batch], ids, strict=True):
                    text = self.model.tokenizer.decode(generated, skip_special=True)
                    out[k] = postprocess_generated_text(text, until, None)
        return out


def _progress(disable_tqdm: bool) -> bool | None:
    return False if disable_tqdm else None  # None: a bar where stderr is a terminal


SAMPLING_KEYS = ("do_sample", "temperature", "top_k", "top_p")  # what generate_until reads (after until, lengths)


def _sampling(settings: dict, until: list[str]) -> Sampling:
    """The Sampling of lm-eval's normalized gen_kwargs, stopping at until: greedy unless do_sample; refused: a
    setting the sampler does not have (beams, penalties, ...), and do_sample at temperature 0."""
    unknown = sorted(set(settings) - set(SAMPLING_KEYS))
    if unknown:
        raise InvalidArgumentError(
            f"gen_kwargs {unknown}: llama-jax generates with until, max_gen_toks and {', '.join(SAMPLING_KEYS)} only"
        )
    if not settings.get("do_sample"):
        return Sampling(stop=tuple(until))
    temperature = float(settings.get("temperature") or 0.0)
    if temperature <= 0.0:
        raise InvalidArgumentError(
            "gen_kwargs do_sample=true at temperature 0: give a temperature > 0, or do_sample=false"
        )
    top_p = settings.get("top_p")
    return Sampling(temperature, settings.get("top_k"), 1.0 if top_p is None else float(top_p), stop=tuple(until))


def _batch_size(value: int | str) -> int:
    """lm-eval's CLI passes batch_size as a string ("8", or "auto" / "auto:N", which mean the default here)."""
    if isinstance(value, str) and value.startswith("auto"):
        return DEFAULT_BATCH
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = 0
    if size < 1:
        raise InvalidArgumentError(f"batch_size={value!r}: a positive integer, or auto")
    return size
