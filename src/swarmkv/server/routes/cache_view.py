"""GET /v1/cache/tree (the prefix cache as JSON, for scripts) and GET /cache (the live page drawing it).

`/v1/cache/tree` answers `{"object": "cache.tree", "page_size": tokens per page, "num_indexed_pages":
pages in the nodes (both tiers), "pool": {...}, "nodes": [...]}`. `nodes` are the tree's view nodes, parents
first (schema in `observability/cache_tree.py`), of the caller's tenant only (an admin key's: every tenant's). `pool`: `page_size`, `pages_total`, `pages_in_use` (held
by a request or a pin), `pages_cached` (indexed, unheld), `pages_free`, `offloaded_bytes` (host tier),
`pinned_bytes`, `prompt_tokens`, `prefix_hit_tokens` and `hit_rate` = prefix_hit_tokens / prompt_tokens
(None before any prompt; the three are None for a tenant's key under `--api-keys`, as they count every tenant's
prompts). The tree, the pins and the counters are read together on the engine's thread, between
steps, so they agree. The tree's export is made there only when the tree or its pages' holders changed since the
last poll (`KVCacheManager.tree_version`); collapsing it for the view happens on a worker thread.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from swarmkv.core.stats import EngineStats
from swarmkv.server.context import request_context
from swarmkv.server.observability.cache_page import PAGE
from swarmkv.server.observability.cache_snapshot import CacheSnapshot
from swarmkv.server.observability.cache_tree import build_view
from swarmkv.server.tenants import Tenant


def pool_json(stats: EngineStats, page_size: int, traffic: bool = True) -> dict[str, Any]:
    """The pool's occupancy and the prefix cache's hit rate, from the engine's stats. Without `traffic` (a
    tenant's view under `--api-keys`), the server-wide token counts and hit rate, which would show it other
    tenants' prompts arriving, are None."""
    pool = {
        "page_size": page_size,
        "pages_total": stats.kv_pages_total,
        "pages_in_use": stats.kv_pages_in_use,
        "pages_cached": stats.kv_pages_cached,
        "pages_free": stats.kv_pages_free,
        "offloaded_bytes": stats.offloaded_bytes,
        "pinned_bytes": stats.pinned_bytes,
        "prompt_tokens": stats.prompt_tokens,
        "prefix_hit_tokens": stats.prefix_hit_tokens,
        "hit_rate": stats.hit_rate,
    }
    if not traffic:
        pool.update(prompt_tokens=None, prefix_hit_tokens=None, hit_rate=None)
    return pool


def tree_json(snapshot: CacheSnapshot, viewer: Tenant) -> dict[str, Any]:
    """The /v1/cache/tree object of one snapshot, as `viewer` may see it."""
    nodes = build_view(snapshot.records, snapshot.pinned, viewer)
    return {
        "object": "cache.tree",
        "page_size": snapshot.page_size,
        "num_indexed_pages": sum(node["pages"] for node in nodes),
        "pool": pool_json(snapshot.stats, snapshot.page_size, traffic=viewer.sees_all),
        "nodes": nodes,
    }


async def cache_tree(request: Request) -> Response:
    """GET /v1/cache/tree: the caller's part of the radix tree (an admin's: all), collapsed for reading, and
    the pool's occupancy."""
    ctx = request_context(request)
    snapshot = await asyncio.wrap_future(ctx.engine.call(ctx.tree_snapshots.take))
    return JSONResponse(await asyncio.to_thread(tree_json, snapshot, ctx.tenant))


async def cache_page(request: Request) -> Response:
    """GET /cache: the live view of the tree, one self-contained HTML page."""
    return HTMLResponse(PAGE, headers={"Cache-Control": "no-cache"})
