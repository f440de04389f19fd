"""Replay prompts through the engine's own scheduler and KV manager, as a server would serve them in order.

No model runs: the scheduler plans each request's prefill chunks and commits them (as `plan --measure`
does), then the request samples its one token and finishes, so its KV stays cached for later requests
exactly as in `swarmkv serve` with `max_tokens: 1` (a finished request's KV covers its prompt and every
generated token but the last: here the prompt). Cached tokens are the engine's `num_cached_tokens`, which
the server reports as `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from swarmkv.core.config import EngineConfig
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.scheduler import Scheduler, SchedulerLimits
from swarmkv.core.sequence import Sequence as EngineRequest
from swarmkv.core.sequence import Status
from swarmkv.core.stats import EngineCounters
from swarmkv.kv import KVCacheManager, Retention, pages_for


@dataclass(frozen=True)
class ReplayRequest:
    """What the engine receives of a request."""

    token_ids: list[int]
    cache_salt: str | None
    session_id: str | None  # the engine's session (for eviction order); None when the server had none
    group: str  # the session the lint assigned it to, for KV per session


@dataclass(frozen=True)
class ReplayResult:
    """Per request cached tokens (None: the pool cannot hold it), and the KV the pool held."""

    cached_tokens: list[int | None]
    kv_bytes: int  # pages holding KV (in use or cached) at the end
    peak_kv_bytes: int
    page_bytes: int
    group_kv_bytes: dict[str, int]  # KV each session's requests held
    group_private_kv_bytes: dict[str, int]  # of that, KV no other session held


def replay(
    requests: Sequence[ReplayRequest],
    page_size: int,
    page_bytes: int,
    kv_cache_bytes: int | None = None,
    check: bool = False,
) -> ReplayResult:
    """Run the requests one after another through a Scheduler over a KVCacheManager (`check`: assert the
    KV books balance at the end, a walk over every page)."""
    if kv_cache_bytes is None:  # every page any request computes, so nothing is ever evicted
        num_pages = 2 + sum(pages_for(len(r.token_ids), page_size) for r in requests)
    else:
        num_pages = kv_cache_bytes // page_bytes
        if num_pages < 2:
            raise ValueError(f"--kv-cache-memory holds {num_pages} page(s) of {page_bytes} bytes; it needs 2")
    defaults = EngineConfig()
    kv = KVCacheManager(num_pages, page_size, retention=Retention(defaults.retention))
    limits = SchedulerLimits(defaults.max_num_seqs, defaults.max_num_batched_tokens)
    scheduler = Scheduler(kv, limits, EngineCounters())
    cached: list[int | None] = []
    peak_pages = 0
    pages_of: dict[str, set[int]] = defaultdict(set)  # session -> its pages, by content
    for number, request in enumerate(requests):
        seq = EngineRequest(
            f"lint-{number}",
            list(request.token_ids),
            SamplingParams(max_tokens=1),
            request.cache_salt,
            arrival=number + 1,
            session_id=request.session_id,
        )
        if len(seq.prompt_token_ids) >= num_pages * page_size:
            cached.append(None)  # the engine refuses a prompt the pool cannot hold
            continue
        if seq.session_id is not None and kv_cache_bytes is not None:
            kv.open_turn(seq)  # as LLMEngine.add_request does: sessions rank pages for eviction
        scheduler.add(seq)
        while seq.status is not Status.FINISHED and seq.num_computed_tokens < seq.num_tokens:
            plan = scheduler.schedule()
            assert plan.chunks or seq.status is Status.FINISHED, "a lone request neither ran nor gave up"
            scheduler.commit(plan.chunks)
            peak_pages = max(peak_pages, kv.num_pages - kv.num_free)
        if seq.status is Status.FINISHED:  # gave up: larger than the pool
            cached.append(None)
            continue
        pages_of[request.group].update(_page_keys(seq.token_ids, request.cache_salt, page_size))
        scheduler.finish(seq, "stop")
        cached.append(seq.num_cached_tokens)
    if check:
        scheduler.check_integrity()
    holders: dict[int, int] = defaultdict(int)
    for keys in pages_of.values():
        for key in keys:
            holders[key] += 1
    return ReplayResult(
        cached_tokens=cached,
        kv_bytes=(kv.num_pages - kv.num_free) * page_bytes,
        peak_kv_bytes=peak_pages * page_bytes,
        page_bytes=page_bytes,
        group_kv_bytes={g: len(keys) * page_bytes for g, keys in pages_of.items()},
        group_private_kv_bytes={
            g: sum(1 for k in keys if holders[k] == 1) * page_bytes for g, keys in pages_of.items()
        },
    )


def _page_keys(tokens: list[int], salt: str | None, page_size: int) -> list[int]:
    """One key per page of `tokens`, equal for two requests exactly when that page's KV is the same (same
    salt and same tokens up to the page's end)."""
    keys, h = [], hash(salt)
    for start in range(0, len(tokens), page_size):
        h = hash((h, tuple(tokens[start : start + page_size])))
        keys.append(h)
    return keys
