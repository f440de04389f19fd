"""Engine counters and the typed stats snapshot that `stats()`, `/metrics`, the cache view and reports read."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


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

    Pins' one-token prefills (`add_pin`) are not requests: their positions count only under the `pin_`
    counters, which keep the same identity among themselves (pin_prefill_tokens_computed ==
    pin_prompt_tokens - pin_prefix_hit_tokens + pin_recomputed_tokens), and their sampled token is not a
    generated token. A request that then reads a pinned prefix counts it as its own prefix hit.
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
    pin_prompt_tokens: int = 0  # pins' prefix positions processed (hit or computed)
    pin_prefill_tokens_computed: int = 0
    pin_prefix_hit_tokens: int = 0
    pin_recomputed_tokens: int = 0
    spec_verify_steps: int = 0  # speculative chunks verified (a request's draft, one a step)
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_sibling_tokens: int = 0  # of those, drafted from replies under the same head
    spec_accepted_session_tokens: int = 0  # drafted from the session's earlier replies
    spec_mtp_draft_tokens: int = 0  # draft tokens the model's MTP layer proposed (and the step verified)
    spec_accepted_mtp_tokens: int = 0  # of those, accepted
    lookahead_steps: int = 0  # async scheduling: steps launched before the previous step's ids were read


@dataclass(frozen=True)
class StateStats:
    """A hybrid model's recurrent-state pool, in slots and bytes."""

    state_bytes_per_sequence: int
    state_slots_total: int
    state_bytes_total: int
    state_bytes_in_use: int
    state_snapshots: int
    state_snapshot_bytes: int
    state_snapshot_stores: int
    state_snapshot_hits: int
    state_snapshot_drops: int


@dataclass(frozen=True)
class EngineStats:
    """One snapshot of the engine's KV and work, in pages, bytes and tokens. Readers use these attributes, so
    a renamed field fails the type check; `to_dict` is the public `stats()` form."""

    kv_bytes_per_token: int
    block_size: int
    kv_pages_total: int
    kv_pages_in_use: int
    kv_pages_cached: int
    kv_pages_free: int
    kv_bytes_in_use: int
    kv_bytes_cached: int
    kv_bytes_logical: int  # the running requests' page tables, as if nothing were shared
    kv_bytes_used: int
    peak_kv_bytes_in_use: int
    peak_kv_bytes_used: int
    prompt_tokens: int
    prefill_tokens_computed: int
    prefix_hit_tokens: int
    recomputed_tokens: int
    generated_tokens: int
    preemptions: int
    swap_preemptions: int
    recompute_preemptions: int
    evictions: int
    offload_capacity_bytes: int
    offloaded_bytes: int
    offload_stores: int
    offload_loads: int
    offload_load_bytes: int
    offload_drops: int
    pins: int
    pinned_bytes: int
    sessions_open: int
    sessions_paused: int
    cascade_decode_rows: int
    cascade_shared_tokens: int
    requests_running: int
    requests_waiting: int
    requests_finished: int
    requests_failed: int
    failed_steps: int
    steps: int
    pin_prompt_tokens: int
    pin_prefill_tokens_computed: int
    pin_prefix_hit_tokens: int
    pin_recomputed_tokens: int
    spec_verify_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_sibling_tokens: int = 0
    spec_accepted_session_tokens: int = 0
    spec_mtp_draft_tokens: int = 0
    spec_accepted_mtp_tokens: int = 0
    lookahead_steps: int = 0
    # Constrained decoding (the engine's, not the core's: zero in a model-free core): grammars compiled and
    # found compiled, tokens a grammar forced, rows whose verbatim loop's continuation was penalised, and
    # rows whose string, looped in, had its closing quote raised.
    grammars_compiled: int = 0
    grammar_cache_hits: int = 0
    forced_tokens: int = 0
    loop_guard_penalties: int = 0
    loop_guard_closing: int = 0
    state: StateStats | None = None  # hybrids only

    @property
    def spec_tokens_per_step(self) -> float | None:
        """Tokens a verification step yielded on average (accepted drafts plus the one it always yields)."""
        if not self.spec_verify_steps:
            return None
        return (self.spec_accepted_tokens + self.spec_verify_steps) / self.spec_verify_steps

    @property
    def kv_bytes_reclaimed(self) -> int:
        """What sharing saves the running requests now: their logical KV beyond the pages they hold."""
        return max(0, self.kv_bytes_logical - self.kv_bytes_in_use)

    @property
    def hit_rate(self) -> float | None:
        """Prompt positions served by the prefix cache, as a fraction (None before any prompt)."""
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else None

    def to_dict(self) -> dict[str, Any]:
        """Flat `{name: number}`, a hybrid's state fields included (absent for a pure transformer)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "state"}
        if self.state is not None:
            out.update(dataclasses.asdict(self.state))
        return out
