"""Engine counters, kept in one place so stats() and metrics read the same numbers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineCounters:
    """Monotonic counters since the engine started."""

    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefix_hit_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    requests_finished: int = 0
    steps: int = 0
    peak_kv_pages_in_use: int = 0
    peak_kv_pages_used: int = 0
