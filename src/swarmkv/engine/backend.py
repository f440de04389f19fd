"""Which kernels a step runs: `torch` (the reference, and the CPU path) or `triton` (GPUs, NVIDIA and AMD).

`auto` is resolved once, when the engine is built: triton on a CUDA or ROCm device (torch reports both as
"cuda"), torch elsewhere, for dense and hybrid models alike. Triton also runs on the CPU under its interpreter (TRITON_INTERPRET=1), slowly:
that is how the CPU test suite checks every kernel.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from typing import Literal

import torch

from swarmkv.choices import AttentionBackendName
from swarmkv.errors import ConfigError

Backend = Literal["torch", "triton"]

log = logging.getLogger(__name__)


def triton_interpreted() -> bool:
    """Whether Triton kernels run under the CPU interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve_attention_backend(name: AttentionBackendName, device: torch.device) -> Backend:
    """The backend `name` means on `device`; ConfigError if triton was asked for and cannot run here."""
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        if device.type == "cuda" and not has_triton:
            log.warning("triton is not installed: attention runs on the slower torch backend")
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if name == "triton":
        if not has_triton:
            raise ConfigError("attention_backend='triton' needs the triton package (pip install triton)")
        if device.type != "cuda" and not triton_interpreted():
            raise ConfigError(
                f"attention_backend='triton' runs on a CUDA or ROCm device, not {device.type!r} "
                "(on the CPU only under Triton's interpreter, TRITON_INTERPRET=1, which is for tests)"
            )
    return name
