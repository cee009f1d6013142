"""The installed package's version (its metadata), "0+unknown" in a source tree that was never installed."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("llama-jax")
except PackageNotFoundError:
    __version__ = "0+unknown"
