"""The package installs as users install it: `python -m build` makes an sdist and, from it, a wheel holding the
compiled kernels; that wheel, installed into a fresh virtual environment and run away from the source tree,
generates text and reports the native path.

The build (most of a minute: every variant's kernels compiled) runs once per state of the source tree: its wheel is
kept in the tests' cache under a hash of every file the build reads (the files git would commit) and of the
compiler, Python, setuptools and jaxlib it builds with, and built again when any of them changes."""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

import jaxlib
import pytest

import llama_jax
from llama_jax.kernels import status
from llama_jax.kernels.variants import VARIANTS
from tests.helpers import suite_cache

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


def _run(args, **kwargs) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, **kwargs)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _source_files() -> list[str]:
    """The files git would commit (tracked, or new and not ignored)."""
    names = _run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT).split()
    return sorted(name for name in names if (ROOT / name).is_file())


def _copy_source(target: Path) -> Path:
    """The files git would commit, copied: builds leave the tree untouched."""
    for name in _source_files():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_bytes((ROOT / name).read_bytes())
    return target


def _build_inputs() -> str:
    """A hash of what the wheel is made of: the source files and the tools that build them."""
    import setuptools

    compiler = os.environ.get("CXX", "c++")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(repr((sys.version, version, setuptools.__version__, jaxlib.__version__)).encode())
    for name in _source_files():
        digest.update(name.encode() + b"\0" + (ROOT / name).read_bytes())
    return digest.hexdigest()[:32]


def built_wheel(tmp_path: Path) -> Path:
    """`python -m build` of a copy of the source tree (an sdist, then the wheel from it), or the wheel it made
    before from the same inputs."""
    kept = suite_cache() / "wheels" / _build_inputs()
    if not kept.is_dir():
        source = _copy_source(tmp_path / "src")
        kept.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=kept.parent) as tmp:
            _run([sys.executable, "-m", "build", "--outdir", str(Path(tmp) / "dist"), str(source)])
            with contextlib.suppress(OSError):  # whole or not at all
                (Path(tmp) / "dist").rename(kept)
    (wheel,) = kept.glob("*.whl")
    return wheel


def test_a_built_wheel_installs_and_runs_without_the_source_tree(tmp_path):
    wheel = built_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    for variant in VARIANTS:  # every instruction-set variant is built into the wheel
        assert any(n.startswith(f"llama_jax/kernels/{variant.module}") for n in names), (variant, names)

    # a fresh environment that sees this one's dependencies (not its llama_jax) through a .pth line
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    child_site = Path(
        _run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    )
    (child_site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps", str(wheel)])

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {**os.environ, "LLAMA_JAX_NATIVE": "require", "LLAMA_JAX_CACHE": str(tmp_path / "cache")}
    where = _run([venv / "bin" / "python", "-c", "import llama_jax; print(llama_jax.__file__)"], cwd=work, env=env)
    assert where.startswith(str(venv)), where
    info = _run([venv / "bin" / "llama-jax", "info"], cwd=work, env=env)
    assert f"native {status('require').variant} kernels" in info, info  # the variant this machine runs
    assert (
        _run([venv / "bin" / "llama-jax", "--version"], cwd=work, env=env).strip()
        == f"llama-jax {llama_jax.__version__}"
    )
    text = _run(
        [venv / "bin" / "llama-jax", "generate", "The capital of France is", "--max-new-tokens", "8"], cwd=work, env=env
    )
    assert "Paris" in text, text


def test_a_failed_native_build_still_installs_and_says_so(tmp_path):
    """Without a working C++ compiler the build warns and the wheel installs without kernels (XLA's path)."""
    env = {**os.environ, "CC": "false", "CXX": "false", "LDSHARED": "false", "LDCXXSHARED": "false"}
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation"]
    source = _copy_source(tmp_path / "src")
    log = subprocess.run(
        [*pip_wheel, "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=900, env=env
    )
    assert log.returncode == 0, log.stderr[-3000:]
    for variant in VARIANTS:
        assert f"the native kernel llama_jax.kernels.{variant.module} was not built" in log.stdout + log.stderr
    (wheel,) = tmp_path.glob("*.whl")
    assert not any("_kernels_" in n for n in zipfile.ZipFile(wheel).namelist())
