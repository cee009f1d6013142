"""The process's memory policy (`runtime.memory.keep_freed_memory`): with it, a large block freed is reused by the
next request (no fresh pages to fault in); it can only be chosen before JAX's first computation, and says so
after. Child processes: the policy is the whole process's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest

from llama_jax import InvalidArgumentError
from llama_jax.runtime import memory

# the child frees a 64 MB block (past glibc's largest mmap threshold, 32 MB), asks for one of the same size again and
# prints its keep_freed_memory() result and the minor page faults of writing the new block
PROBE = textwrap.dedent("""
    import ctypes, ctypes.util, resource, sys
    from llama_jax.runtime import memory
    kept = memory.keep_freed_memory() if sys.argv[1] == "keep" else None
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 << 20
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 2, size)
    print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _faults(mode: str) -> tuple[str, int]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=300, cwd=os.getcwd()
    )
    assert done.returncode == 0, done.stderr
    kept, faults = done.stdout.split()
    return kept, int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux")
def test_kept_memory_is_reused_by_the_next_call():
    """Without the policy a freed 64 MB block goes back to the system and the next one faults in fresh pages (at
    least a quarter of its 16,384); with it, the next request reuses the freed block (under 1% of them). XLA's
    large buffers are allocated and freed so every call (a weight gradient: ~280,000 faults a call without)."""
    kept, faults = _faults("keep")
    if kept != "True":
        pytest.skip("the C library is not glibc: keep_freed_memory changes nothing")
    _, fresh = _faults("default")
    assert fresh > 4_096
    assert faults < 164


def test_the_policy_is_refused_after_the_first_computation():
    """After a JAX computation XLA's threads hold their own arenas: choosing the policy then raises, saying when
    to call it."""
    jnp.zeros(1).block_until_ready()
    with pytest.raises(InvalidArgumentError, match=r"before llama_jax\.load\(\)"):
        memory.keep_freed_memory()
