"""The type checks' import hook (installed before the package is imported) and the shared fixtures: the default
model (llama-jax and transformers, the same GGUF file) and its prompts' ids. The helpers are in tests/helpers.py."""

from __future__ import annotations

import contextlib
import gc
import os
import tempfile
from pathlib import Path

# torch's OpenMP threads spin after each parallel region by default: with two test workers on two cores, the
# spinning took the other worker's core (two heavy torch-beside-jax files in two workers: 130 s, 84 s when they
# sleep). Set before torch is first imported; the subprocesses the tests start inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import jaxtyping
import pytest

# jaxtyping checks every annotated function of the package at run time in the tests (shapes and dtypes, with
# beartype): every module, found by walking the package, so a new one is checked from its first line; installed
# here, before any of them is imported. Left out: the pytree containers that jax rebuilds with non-array leaves
# (specs, None; ggml blocks hold numpy arrays while they load), and the front ends whose public functions check
# their own arguments and raise InvalidArgumentError / SamplingError for a wrong type (which a type check would
# pre-empt).
UNCHECKED = {
    "llama_jax.core.weights", "llama_jax.core.kv_cache", "llama_jax.core.quantized", "llama_jax.nn.block",
    "llama_jax.model", "llama_jax.cli", "llama_jax.lm_eval", "llama_jax.lens",
    "llama_jax.passes.score", "llama_jax.passes.generate", "llama_jax.passes.decode_batch", "llama_jax.passes.sampling",
    "llama_jax.loaders", "llama_jax.text",
}  # fmt: skip
_PACKAGE = Path(__file__).parents[1] / "llama_jax"
_MODULES = [  # by name, a package's __init__.py as the package
    ".".join(p.relative_to(_PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in _PACKAGE.rglob("*.py")
]
# the hook matches names by prefix: a package is named only where none of its modules is left out
CHECKED = [
    m for m in _MODULES
    if not any(m == u or m.startswith(u + ".") or u.startswith(m + ".") for u in UNCHECKED)
]  # fmt: skip
jaxtyping.install_import_hook(CHECKED, "beartype.beartype")  # by name, not imported: the hook must come first

import llama_jax  # noqa: E402 (after the hook)
from llama_jax.runtime import executables  # noqa: E402
from tests.helpers import PROMPTS, memory_mappings, share_compilations, suite_cache  # noqa: E402

share_compilations()  # JAX's compilation cache, for this process and every one the tests start (tests/helpers.py)


# The files that take longest, longest first (a cold run on 2 cores): pytest-xdist hands whole files to the
# workers in this order (`make test`: --dist loadfile --no-loadscope-reorder), the rest after them, so that the
# files that start last are short ones and the workers end together.
SLOWEST_FIRST = (
    "test_serve.py", "test_readme.py", "test_research.py", "test_patching.py", "test_stored.py", "test_install.py",
    "test_sharding.py", "test_batch_invariance.py", "test_multiprocess.py", "test_store.py", "test_family.py",
    "test_cli.py", "test_real_model.py", "test_examples.py", "test_checkpoints.py", "test_lm_eval.py",
    "test_products.py", "test_block_attention.py", "test_convert.py", "test_kernels.py",
)  # fmt: skip


@pytest.fixture(autouse=True, scope="module")
def _code_unmapped_past_a_third_of_the_limit():
    """After a test file, a worker past a third of Linux's limit on a process's memory mappings lets its executables
    go (`executables.release`): XLA maps each code section of each program on its own, and a worker that had run
    four fifths of the suite's files reached the limit (65530) and aborted in LLVM's loader while it read a program
    from the compilation cache (SmolLM2's test_rope alone maps 5,000; a release brings a worker back to ~1,100)."""
    yield
    count, limit = memory_mappings()
    if count > limit // 3:
        executables.release()
        gc.collect()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: in a file, and the others, as found


@pytest.fixture(scope="session")
def default_path() -> Path:
    return llama_jax.default_model_path()


@pytest.fixture(scope="session")
def model() -> llama_jax.Model:
    return llama_jax.load()


@pytest.fixture(scope="session")
def hf_model(default_path):
    """transformers' LlamaForCausalLM (float32, eager attention) dequantized by transformers from the same GGUF:
    once per file and version of transformers and torch, its config and tensors then kept in the tests' cache
    and read back from there (the same config, the same tensors bit for bit, embeddings tied as loaded), a
    second instead of the GGUF reader's fifteen."""
    torch = pytest.importorskip("torch")
    import transformers
    from safetensors.torch import load_model, save_model
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    stat = default_path.stat()
    key = f"{default_path.name}-{stat.st_size}-{stat.st_mtime_ns}-{transformers.__version__}-{torch.__version__}"
    folder = suite_cache() / "transformers" / key
    if (folder / "model.safetensors").is_file():
        hf = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(folder), dtype=torch.float32, attn_implementation="eager"
        )
        load_model(hf, folder / "model.safetensors")
        hf.generation_config = GenerationConfig.from_pretrained(folder)
        return hf.eval()
    hf = AutoModelForCausalLM.from_pretrained(
        str(default_path.parent), gguf_file=default_path.name, dtype=torch.float32, attn_implementation="eager"
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        written = Path(tmp) / "model"
        hf.config.save_pretrained(written)
        hf.generation_config.save_pretrained(written)
        save_model(hf, str(written / "model.safetensors"))
        with contextlib.suppress(OSError):  # whole or not at all; a worker that got there first keeps its copy
            written.rename(folder)
    return hf.eval()


@pytest.fixture(scope="session")
def prompt_ids(model) -> list[list[int]]:
    ids = [model.tokenizer.encode(p) for p in PROMPTS]
    assert all(len(i) >= 64 for i in ids)
    return ids
