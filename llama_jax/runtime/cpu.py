"""The CPU's instruction sets, as Linux names them in /proc/cpuinfo: read once per process, for the choice of a
native kernel variant (`kernels`) and the key of a compiled executable (`runtime.executables`), which XLA
compiles for the host CPU."""

from __future__ import annotations

import functools
import re
from pathlib import Path


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The flags of the first CPU (avx2, fma, avx512f, ...); None where the system does not say (no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return frozenset(match.group(1).split()) if match else None
