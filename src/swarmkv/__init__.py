"""swarmkv: an inference engine for local agent swarms that stores a shared prompt prefix's KV once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmkv.core.sampling_params import SamplingParams
    from swarmkv.engine.llm import LLM, RequestOutput

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Loaded on first use, so that `import swarmkv.kv` or `swarmkv.core` (bookkeeping, no tensors) loads no torch.
    if name in ("LLM", "RequestOutput"):
        from swarmkv.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from swarmkv.core.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'swarmkv' has no attribute {name!r}")
