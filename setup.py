"""Builds the native kernels (llama_jax/kernels/*.cc) once per instruction-set variant when the package is
built or installed, against the XLA FFI headers that jaxlib ships. A variant that fails to compile is left out
with a warning, and the package installs anyway: llama-jax then runs XLA's own products (same numbers, slower)
and says so once at run time. Everything else about the package is in pyproject.toml."""

from __future__ import annotations

import copy
import platform
import runpy
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
KERNELS = HERE / "llama_jax" / "kernels"
# one library per variant from every source there, rebuilt when a header changes (the Makefile's wildcard)
SOURCES = sorted(path.name for path in KERNELS.glob("*.cc"))
HEADERS = sorted(path.name for path in KERNELS.glob("*.h"))
variants = runpy.run_path(str(KERNELS / "variants.py"))


def _ffi_include_dir() -> str | None:
    try:
        import jaxlib
    except ImportError:
        return None
    include = Path(jaxlib.__file__).parent / "include"
    return str(include) if (include / "xla" / "ffi" / "api" / "ffi.h").exists() else None


class BuildKernels(build_ext):
    """build_ext that adds the FFI headers, builds the variants side by side (one per core: setuptools' parallel
    build), each from its own object files, and never fails the install over a kernel."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:
            self.parallel = True  # as many at once as there are cores

    def build_extension(self, ext: Extension) -> None:
        include = _ffi_include_dir()
        if include is None:
            self._skip(ext, "jaxlib's XLA FFI headers were not found in the build environment")
            return
        ext.extra_compile_args = [*ext.extra_compile_args, "-isystem", include]  # its warnings are not ours
        # the variants compile the same sources: each into its own folder, or one would link the other's objects
        own = copy.copy(self)
        own.build_temp = str(Path(self.build_temp) / ext.name.rpartition(".")[2])
        try:
            build_ext.build_extension(own, ext)
        except Exception as e:  # a compiler error, a missing compiler: the XLA path runs instead
            self._skip(ext, f"{type(e).__name__}: {e}")

    def _skip(self, ext: Extension, why: str) -> None:
        print(
            f"llama-jax: WARNING: the native kernel {ext.name} was not built ({why}); where no other variant is"
            " built, llama-jax runs XLA's products instead (the same numbers, slower). Install a C++ compiler (g++)"
            " and reinstall to build it.",
            file=sys.stderr,
        )


def _extensions() -> list[Extension]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return []  # the kernels are written with x86-64 intrinsics
    return [
        Extension(
            f"llama_jax.kernels.{v.module}",
            sources=[f"llama_jax/kernels/{name}" for name in SOURCES],
            depends=[f"llama_jax/kernels/{name}" for name in HEADERS],
            language="c++",
            extra_compile_args=[*variants["COMMON_FLAGS"], *v.compile_flags],
        )
        for v in variants["VARIANTS"]
    ]


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildKernels})
