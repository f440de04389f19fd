"""Paged KV bookkeeping: the page pool and the prefix caches that share pages between sequences."""

from swarmkv.kv.no_sharing import NoSharingCache
from swarmkv.kv.page_pool import PagePool, pages_for
from swarmkv.kv.prefix_cache import PartialHit, PrefixCache, PrefixMatch
from swarmkv.kv.radix_cache import RadixCache

__all__ = [
    "NoSharingCache",
    "PagePool",
    "PartialHit",
    "PrefixCache",
    "PrefixMatch",
    "RadixCache",
    "pages_for",
]
