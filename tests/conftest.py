"""Fixtures shared across test modules."""

from __future__ import annotations

import os

import pytest
import torch

# Triton reads TRITON_INTERPRET when it is first imported, and importing transformers' Qwen3.5 model imports it;
# those test modules are collected before the kernel tests, so the CPU interpreter is chosen here, first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist each worker gets its share of the cores, so workers do not oversubscribe them.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

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
