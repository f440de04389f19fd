"""Engine counters, kept in one place so stats() and metrics read the same numbers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineCounters:
    """Monotonic counters since the engine started.

    Token accounting: every prompt position is processed once, either served by the prefix cache
    (`prefix_hit_tokens`) or computed (`prefill_tokens_computed`); positions computed again after a
    preemption or an eviction count in `recomputed_tokens` and in `prefill_tokens_computed`. Hence,
    always: prefill_tokens_computed == prompt_tokens - prefix_hit_tokens + recomputed_tokens.

    A session is counted as one long sequence: a new turn's positions that the session's previous turn had
    already processed count again neither as prompt tokens nor as hits, and computing them again (their
    pages were evicted) counts as recomputed.
    """

    prompt_tokens: int = 0  # prompt positions processed (hit or computed for the first time)
    prefill_tokens_computed: int = 0
    prefix_hit_tokens: int = 0
    recomputed_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    swap_preemptions: int = 0  # preemptions whose private pages went to the host tier
    recompute_preemptions: int = (
        0  # preemptions that leave the pages to be recomputed (or hit if still cached)
    )
    requests_finished: int = 0
    requests_failed: int = 0
    failed_steps: int = 0
    steps: int = 0
    cascade_decode_rows: int = 0  # decode rows that read a shared prefix once per group
    cascade_shared_tokens: int = 0  # prefix tokens those groups read once instead of once per row
    peak_kv_pages_in_use: int = 0
    peak_kv_pages_used: int = 0
