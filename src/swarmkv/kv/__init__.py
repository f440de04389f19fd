"""Paged KV bookkeeping, no tensors: the page pool, the radix prefix index and the manager over both."""

from swarmkv.kv.manager import NO_HIT, Hit, KVCacheManager, KVRequest
from swarmkv.kv.page_pool import PagePool, pages_for
from swarmkv.kv.radix_index import PartialHit, RadixIndex

__all__ = [
    "NO_HIT",
    "Hit",
    "KVCacheManager",
    "KVRequest",
    "PagePool",
    "PartialHit",
    "RadixIndex",
    "pages_for",
]
