"""Paged KV bookkeeping, no tensors: the page pool, the radix prefix index and the manager over both."""

from swarmkv.kv.host_tier import HostTier, PageMover
from swarmkv.kv.manager import KVCacheManager
from swarmkv.kv.page_pool import PagePool, pages_for
from swarmkv.kv.radix_index import PartialHit, RadixIndex
from swarmkv.kv.request import NO_HIT, Hit, KVRequest
from swarmkv.kv.retention import RETENTION_POLICIES, Rank, Retention, RetentionPolicy

__all__ = [
    "NO_HIT",
    "RETENTION_POLICIES",
    "Hit",
    "HostTier",
    "KVCacheManager",
    "KVRequest",
    "PageMover",
    "PagePool",
    "PartialHit",
    "RadixIndex",
    "Rank",
    "Retention",
    "RetentionPolicy",
    "pages_for",
]
