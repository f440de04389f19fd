"""The naive layout: every sequence owns private pages and nothing outlives it (a per-slot engine)."""

from __future__ import annotations

from collections.abc import Sequence

from swarmkv.kv.prefix_cache import PrefixCache, PrefixMatch, Salt


class NoSharingCache(PrefixCache):
    """A prefix cache that never matches and never keeps a page once its sequence lets go."""

    shares_pages = False

    def match(self, tokens: Sequence[int], salt: Salt) -> PrefixMatch:
        """Nothing is ever shared."""
        return PrefixMatch()

    def insert(self, tokens: Sequence[int], pages: list[int], salt: Salt, partial: bool = False) -> list[int]:
        """Pages stay private to their sequence."""
        return pages

    def num_evictable(self) -> int:
        """Nothing is cached, so nothing can be evicted."""
        return 0

    def evict(self, num_pages: int) -> int:
        """Nothing is cached, so nothing is evicted."""
        return 0

    def is_cached(self, page: int) -> bool:
        """No page is ever indexed."""
        return False

    def _check_index(self) -> None:
        assert self.num_cached == 0, "the no-sharing cache keeps no pages"
