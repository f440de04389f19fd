"""Fixtures shared across test modules."""

from __future__ import annotations

import pytest

from conftest_tokenizer_helpers import qwen_tokenizer, smol_tokenizer
from swarmkv.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    """Our tokenizer for the default SmolLM2 GGUF."""
    return smol_tokenizer()


@pytest.fixture(scope="module")
def qwen() -> Tokenizer:
    """Our tokenizer for the Qwen3 HF files."""
    return qwen_tokenizer()
