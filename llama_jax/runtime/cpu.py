"""The CPU's instruction sets, as Linux names them in /proc/cpuinfo: read once per process, for the choice of a
native kernel variant (`kernels`) and the key of a compiled executable (`runtime.executables`), which XLA
compiles for the host CPU; which CPU it is (`llama-jax info`, the benchmarks) and the sizes of its L1 data and
L2 caches (the kernels' tuning)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import NamedTuple


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The flags of the first CPU (avx2, fma, avx512f, ...); None where the system does not say (no /proc/cpuinfo)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return frozenset(match.group(1).split()) if match else None


class CpuId(NamedTuple):
    """Which CPU this is: the vendor, family and model numbers that tell its microarchitecture (AMD family 25
    model 17: Zen 4), and its marketing name, from the first core's fields in /proc/cpuinfo."""

    vendor: str
    family: int
    model: int
    name: str

    def __str__(self) -> str:
        return f"{self.name} ({self.vendor} family {self.family} model {self.model})"


@functools.cache
def cpu_id() -> CpuId | None:
    """This CPU's `CpuId`; None where the system does not say."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return None
    fields = {key.strip(): value.strip() for key, _, value in (line.partition(":") for line in first.splitlines())}
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return None
    return CpuId(fields.get("vendor_id", "?"), family, model, fields.get("model name", "?"))


def _cache_bytes(level: str, kinds: tuple[str, ...]) -> int | None:
    """The size in bytes of cpu0's cache of this level and one of these types (sysfs), None where not said."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() == level and (index / "type").read_text().strip() in kinds:
                size = (index / "size").read_text().strip()  # "32K"
                return int(size[:-1]) * 1024 if size.endswith("K") else int(size)
        except (OSError, ValueError):
            continue
    return None


@functools.cache
def l1_data_bytes() -> int | None:
    """A core's level-1 data cache in bytes (sysfs), None where the system does not say."""
    return _cache_bytes("1", ("Data",))


@functools.cache
def l2_bytes() -> int | None:
    """A core's level-2 cache in bytes (sysfs), None where the system does not say."""
    return _cache_bytes("2", ("Unified", "Data"))
