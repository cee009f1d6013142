"""Compiled executables kept on disk, so that a new process runs prefill and decode without tracing them again.

JAX's persistent compilation cache saves only XLA's compile: every process still traces and lowers each jitted
function (about 0.25 s for prefill, more for the decode loop). `persistent_jit(fn, **options)` is `jax.jit(fn,
**options)` whose compiled executables are also serialized (`jax.experimental.serialize_executable`) under
$LLAMA_JAX_CACHE/executables (see `runtime.disk`) and loaded in later processes instead of traced.

The key of an executable holds everything its code depends on: the function, its static arguments (the config,
the window, ...), the structure, shapes and dtypes of its array arguments, the versions of jax and jaxlib, a hash
of llama-jax's own source, the device, the CPU's instruction sets (XLA compiles for the host CPU), XLA_FLAGS and
the jax settings that change lowering. A change of any of them misses the cache; nothing else can make it load a
wrong executable. Arrays placed on several devices (a mesh), and calls from inside another traced function, take
plain `jax.jit`. An unreadable entry is recompiled and written again. An executable that JAX's own persistent
compilation cache returned is not written (it does not serialize whole); the CLI leaves that cache off. The
executables of the KEEP most recent environments stay on disk, older ones are removed. LLAMA_JAX_CACHE=off turns
the disk off (then this is `jax.jit`). The entries are pickles, trusted as the user's own files (as JAX trusts
its compilation cache).

`release()` lets a process's executables go (their code unmapped): XLA's CPU JIT maps every code section of every
executable on its own, and Linux bounds a process's mappings (vm.max_map_count, 65530 by default), so a process
that keeps thousands of programs (a test run's worker) would abort in LLVM's loader ("Unable to allocate section
memory", or a segfault) when it loads one more.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import pickle
import shutil
import tempfile
import weakref
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax.experimental import serialize_executable

from llama_jax.runtime.cpu import cpu_flags
from llama_jax.runtime.disk import cache_root

# how often each function was traced (compiled here) or loaded from disk in this process, by name (the tests
# read them: a warm start traces nothing)
COUNTS: Counter[str] = Counter()
KEEP = 4  # environments (jax and llama-jax versions, ...) whose executables stay on disk
_CACHE_HITS = [0]  # hits of JAX's persistent compilation cache in this process (any thread)
_EVERY: weakref.WeakSet[PersistentJit] = weakref.WeakSet()  # this process's PersistentJits (release())


def _count_hit(event: str, **_: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _CACHE_HITS[0] += 1


jax.monitoring.register_event_listener(_count_hit)


@functools.cache
def _environment() -> str:
    """A hash of what every executable of this process depends on besides its arguments: the name of the folder
    its executables go in."""
    source = hashlib.sha256()
    for path in sorted(Path(__file__).parents[1].rglob("*.py")):  # the whole package
        source.update(path.read_bytes())
    device = jax.devices()[0]
    flags = sorted(cpu_flags() or ())
    settings = (jax.config.jax_enable_x64, jax.config.jax_default_matmul_precision, os.environ.get("XLA_FLAGS"))
    environment = (jax.__version__, jaxlib.version.__version__, source.hexdigest(), device.platform,
                   device.device_kind, len(jax.devices()), flags, settings)  # fmt: skip
    return hashlib.sha256(repr(environment).encode()).hexdigest()[:32]


def _prune(folder: Path) -> None:
    """Removes all but the KEEP most recently written environments' folders beside `folder` (an upgrade of jax
    or llama-jax leaves the old ones unused)."""
    others = sorted((p for p in folder.parent.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for old in others[:-KEEP]:
        shutil.rmtree(old, ignore_errors=True)


def _aval(leaf: Any) -> tuple:
    return (tuple(leaf.shape), str(leaf.dtype), bool(getattr(leaf, "weak_type", False)))


def on_one_device(leaf: Any) -> bool:
    """Whether an array lies whole on one device (a host value counts as one)."""
    sharding = getattr(leaf, "sharding", None)
    return sharding is None or len(sharding.device_set) == 1


def _traced(leaves: list) -> bool:
    """Whether this is a call inside another function being traced (its arguments are tracers)."""
    return any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)


def _device(leaf: Any) -> jax.Device | None:
    """The device a single-device array is on; None for host values."""
    sharding = getattr(leaf, "sharding", None)
    return None if sharding is None else next(iter(sharding.device_set))


class PersistentJit:
    """`jax.jit(fn, **options)` with its executables on disk (see the module). Called like the jitted function;
    static arguments by keyword. `__wrapped__` is fn."""

    def __init__(self, fn: Callable, **options: Any):
        self.__wrapped__ = fn
        self.name = f"{fn.__module__}.{fn.__qualname__}"
        self.static = tuple(options.get("static_argnames", ()))
        self.jitted = jax.jit(fn, **options)
        self.signature = inspect.signature(fn)
        self.loaded: dict[tuple[str, int], Callable] = {}  # by key and device, in this process
        functools.update_wrapper(self, fn)
        _EVERY.add(self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        root = cache_root()
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()  # every argument by name: the executable is called with the dynamic ones
        dynamic = {k: v for k, v in bound.arguments.items() if k not in self.static}
        leaves, tree = jax.tree.flatten(dynamic)
        if root is None or not all(on_one_device(leaf) for leaf in leaves) or _traced(leaves):
            return self.jitted(*args, **kwargs)
        static = [(k, repr(v)) for k, v in bound.arguments.items() if k in self.static]
        device = next((_device(x) for x in leaves if _device(x) is not None), jax.devices()[0])
        avals = [_aval(x) for x in leaves]
        key = hashlib.sha256(repr((self.name, static, str(tree), avals)).encode()).hexdigest()
        compiled = self.loaded.get((key, device.id))
        if compiled is None:
            path = root / "executables" / _environment() / f"{key}.bin"
            compiled = self.loaded[key, device.id] = self._load_or_compile(path, bound.arguments, device)
        return compiled(**dynamic)

    def _load_or_compile(self, path: Path, arguments: dict[str, Any], device: jax.Device) -> Callable:
        try:
            blob, in_tree, out_tree = pickle.loads(path.read_bytes())
            compiled = serialize_executable.deserialize_and_load(blob, in_tree, out_tree, execution_devices=[device])
            COUNTS[f"{self.name}:loaded"] += 1
            return compiled
        except Exception:  # missing, unreadable or from an incompatible build: compile it (again)
            pass
        COUNTS[f"{self.name}:traced"] += 1
        hits = _CACHE_HITS[0]
        compiled = self.jitted.lower(**arguments).compile()
        if _CACHE_HITS[0] != hits:  # JAX's compilation cache gave it: such an executable does not serialize whole
            return compiled  # (once loaded it fails to run, a kernel missing: measured), so it is not written
        try:
            if not path.parent.is_dir():
                path.parent.mkdir(parents=True)
                _prune(path.parent)
            with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
                f.write(pickle.dumps(serialize_executable.serialize(compiled)))
            os.replace(f.name, path)  # whole or not at all, for a process reading it at the same time
        except (OSError, TypeError, ValueError, pickle.PicklingError):  # a full disk, an unpicklable tree
            pass
        return compiled


def release() -> None:
    """Lets go of every executable this process holds in memory: each PersistentJit's (loaded from disk again at
    its next call) and JAX's own caches (`jax.clear_caches`); their code is unmapped once nothing else holds them.
    For a long-lived process that has run thousands of programs (see the module)."""
    for jitted in list(_EVERY):
        jitted.loaded.clear()
    jax.clear_caches()


def persistent_jit(**options: Any) -> Callable[[Callable], PersistentJit]:
    """A decorator: `@persistent_jit(static_argnames=..., donate_argnames=...)`."""
    return lambda fn: PersistentJit(fn, **options)
