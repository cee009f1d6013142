"""The process's memory policy for large per-call buffers: keep what is freed, for the next call.

XLA's CPU runtime allocates every temporary and result of a call afresh (malloc) and frees it after. With glibc's
defaults the large ones come from mmap or from the heaps of XLA's threads' own arenas, and go back to the system
when freed, so every call touches fresh pages that the kernel must fault in and zero first: a 256-token weight
gradient of SmolLM2-135M takes ~280,000 such faults (1.1 GB) a call, 0.6-1.3 s of system time on a 2-core VM
(more right after another engine in the process freed its own memory: the host then backs each page again).
`keep_freed_memory` makes glibc keep freed memory for reuse instead (that gradient: no faults after its first
call; a lone huge buffer may still miss its freed block by the alignment's slack now and then). A process-wide
choice (every library's allocations share one arena and stay with the process: its resident size stays near its
peak), so it is the caller's to make, before the first computation (XLA's threads take their arenas then).
"""

from __future__ import annotations

import ctypes
import ctypes.util

from jax._src import xla_bridge

from llama_jax.errors import InvalidArgumentError

# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


def keep_freed_memory() -> bool:
    """Make this process's allocator (glibc) keep the memory it frees for reuse: one arena for every thread, no
    block from mmap, the heap trimmed only past 2 GB free at its top. True where applied; False where the C library
    is not glibc (nothing changed). Call it before the first JAX computation of the process (loading a model runs
    some): afterwards XLA's threads have taken arenas it cannot change, and it raises InvalidArgumentError.
    Measured on a 2-core Zen 3 VM: a 256-token weight gradient 2.03-2.09 s → 1.75-1.89 s, no page faults after the
    first call (docs/performance.md)."""
    if xla_bridge.backends_are_initialized():
        raise InvalidArgumentError(
            "keep_freed_memory() after JAX's first computation: XLA's threads already hold their own arenas, which"
            " it cannot change; call it first thing in the process, before llama_jax.load() or any jax operation"
        )
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    settings = ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1))
    return all(libc.mallopt(parameter, value) == 1 for parameter, value in settings)
