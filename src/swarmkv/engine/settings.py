"""The engine's resolved settings, read from the parts that hold them once they are built: each was decided by
`swarmkv.resolve` from the config and facts about the device and the model."""

from __future__ import annotations

from swarmkv.core.scheduler import SchedulerLimits
from swarmkv.engine.kv_budget import KVBudget, dtype_name
from swarmkv.engine.runner import ModelRunner
from swarmkv.models.loader import LoadedModel
from swarmkv.resolve import EngineSettings


def engine_settings(
    loaded: LoadedModel,
    budget: KVBudget,
    runner: ModelRunner,
    limits: SchedulerLimits,
    jump_forward: bool,
    speculation: bool,
    async_scheduling: bool,
) -> EngineSettings:
    """What an engine over `loaded` runs with, no `auto` left."""
    return EngineSettings(
        device=str(loaded.device),
        dtype=dtype_name(loaded.dtype),
        weights=loaded.weights,
        kv_cache_dtype=dtype_name(budget.kv_dtype),
        kv_bytes_per_token=budget.kv_bytes_per_token,
        attention_backend=runner.backend,
        cascade_attention=runner.min_saved_tokens is not None,
        cascade_min_saved_tokens=runner.min_saved_tokens,
        cuda_graphs=runner.cuda_graphs,
        async_scheduling=async_scheduling,
        speculation=speculation,
        max_speculative_rows=limits.max_speculative_rows,
        max_num_partial_prefills=limits.max_num_partial_prefills,
        jump_forward=jump_forward,
        fused_cpu_decode=runner.cpu_decode is not None,
        cpu_prefill_bf16=runner.prefill_bf16,
        cpu_prefill_int8=runner.prefill_int8,
        mtp_drafts=speculation and runner.model.mtp is not None and runner.triton is None,
        offload_memory=budget.num_host_pages * budget.page_bytes,
    )
