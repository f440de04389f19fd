"""The cache view's snapshot of the engine: the tree's export, the pins and the stats, read together between steps.

The export walks every node, so it is made only when the tree or its pages' holders changed since the last
poll (`KVCacheManager.tree_version`); a page polling `/v1/cache/tree` every second costs the engine's thread
almost nothing while nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarmkv.core.stats import EngineStats
from swarmkv.engine.engine import LLMEngine


@dataclass(frozen=True)
class CacheSnapshot:
    """What the engine thread reads in one go."""

    records: list[dict[str, Any]]  # shared between polls at one tree version: read it, do not change it
    pinned: frozenset[int]
    stats: EngineStats
    page_size: int
    version: tuple[int, int]


class TreeSnapshots:
    """Takes snapshots on the engine's thread, reusing the last export while the tree has not changed."""

    def __init__(self) -> None:
        self._last: CacheSnapshot | None = None  # touched only on the engine's thread

    def take(self, engine: LLMEngine) -> CacheSnapshot:
        """The tree, the pins and the stats as they are now, between steps."""
        kv, last = engine.core.kv, self._last
        version = kv.tree_version
        records = last.records if last is not None and last.version == version else kv.export()
        self._last = CacheSnapshot(records, kv.all_pinned_pages(), engine.snapshot(), kv.page_size, version)
        return self._last
