"""Which kernels a step runs: `torch` (the reference, and the CPU path) or `triton` (GPUs, NVIDIA and AMD).

`auto` is resolved once, when the engine is built (swarmkv/resolve.py): triton on a CUDA or ROCm device (torch
reports both as "cuda"), torch elsewhere, for dense and hybrid models alike. Triton also runs on the CPU under its interpreter (TRITON_INTERPRET=1), slowly:
that is how the CPU test suite checks every kernel.
"""

from __future__ import annotations

import importlib.util
import os

import torch

import swarmkv.resolve as resolve
from swarmkv.choices import AttentionBackendName
from swarmkv.resolve import Backend

__all__ = ["Backend", "resolve_attention_backend", "triton_interpreted"]


def triton_interpreted() -> bool:
    """Whether Triton kernels run under the CPU interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_attention_backend(name: AttentionBackendName, device: torch.device) -> Backend:
    """The backend `name` means on `device` (`swarmkv.resolve.attention_backend`, given whether triton is
    installed and interpreted here); ConfigError if triton was asked for and cannot run here."""
    has_triton = importlib.util.find_spec("triton") is not None
    return resolve.attention_backend(name, device.type, has_triton, triton_interpreted())
