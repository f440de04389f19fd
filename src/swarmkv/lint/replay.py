"""Replay prompts through the engine core (scheduler, KV manager, sessions), as a server would serve them in order.

No model runs: `EngineCore.prefill` plans each request's prefill chunks and commits them (as `plan --measure`
does), then the request finishes as one with `max_tokens: 1` does, so its KV stays cached for later requests
exactly as in `swarmkv serve` (a finished request's KV covers its prompt and every generated token but the
last: here the prompt). Cached tokens are the engine's `num_cached_tokens`, which the server reports as
`usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from swarmkv.core.config import EngineConfig
from swarmkv.core.core import EngineCore
from swarmkv.kv import pages_for


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
    """Run the requests one after another through an engine core (`check`: assert the KV books balance at
    the end, a walk over every page)."""
    if kv_cache_bytes is None:  # every page any request computes, so nothing is ever evicted
        num_pages = 2 + sum(pages_for(len(r.token_ids), page_size) for r in requests)
    else:
        num_pages = kv_cache_bytes // page_bytes
        if num_pages < 2:
            raise ValueError(f"--kv-cache-memory holds {num_pages} page(s) of {page_bytes} bytes; it needs 2")
    # The server's defaults: its retention policy and its sessions (a request without a session when the
    # pool is unbounded, where eviction order cannot matter).
    core = EngineCore(EngineConfig(block_size=page_size), num_pages, page_bytes=page_bytes)
    cached: list[int | None] = []
    pages_of: dict[str, set[int]] = defaultdict(set)  # session -> its pages, by content
    for number, request in enumerate(requests):
        session = request.session_id if kv_cache_bytes is not None else None
        seq = core.prefill(f"lint-{number}", list(request.token_ids), request.cache_salt, session)
        if seq is None:  # the pool cannot hold it
            cached.append(None)
            continue
        pages_of[request.group].update(_page_keys(seq.prompt_token_ids, request.cache_salt, page_size))
        cached.append(seq.num_cached_tokens)
    if check:
        core.check_integrity()
    stats = core.snapshot()
    holders: dict[int, int] = defaultdict(int)
    for keys in pages_of.values():
        for key in keys:
            holders[key] += 1
    return ReplayResult(
        cached_tokens=cached,
        kv_bytes=stats.kv_bytes_used,
        peak_kv_bytes=stats.peak_kv_bytes_used,
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
