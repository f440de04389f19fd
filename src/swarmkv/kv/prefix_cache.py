"""The interface every prefix cache offers the scheduler, and the integrity checks they share."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from swarmkv.kv.page_pool import PagePool, pages_for

Salt = str | None


@dataclass(frozen=True)
class PartialHit:
    """A cached, partly filled last page whose first `num_tokens` slots hold KV the caller can reuse."""

    page: int
    num_tokens: int


@dataclass(frozen=True)
class PrefixMatch:
    """Full pages retained for the caller, and possibly a partial page it may claim to continue in."""

    pages: list[int] = field(default_factory=list)
    partial: PartialHit | None = None

    def num_tokens(self, block_size: int) -> int:
        """Tokens whose KV the match provides once the partial page (if any) is claimed."""
        return len(self.pages) * block_size + (self.partial.num_tokens if self.partial else 0)


class PrefixCache(ABC):
    """Owns the page pool; decides which unheld pages stay cached and which go back to the free list."""

    shares_pages: ClassVar[bool] = True

    def __init__(self, pool: PagePool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.num_evictions = 0

    @abstractmethod
    def match(self, tokens: Sequence[int], salt: Salt) -> PrefixMatch:
        """The longest cached prefix of `tokens`: full pages (retained for the caller) and a partial page."""

    @abstractmethod
    def insert(self, tokens: Sequence[int], pages: list[int], salt: Salt, partial: bool = False) -> list[int]:
        """Offer a sequence's full pages, and with `partial` its partly filled last page too (when it stops
        running); `tokens` are those whose KV the pages hold. Returns its page list after dedup."""

    def claim(self, hit: PartialHit) -> int:
        """Take a partial page out of the cache, held once by the caller, who will write past its tokens."""
        raise NotImplementedError(f"{type(self).__name__} never offers partial pages")

    @abstractmethod
    def num_evictable(self) -> int:
        """Cached pages no sequence holds: they can be reclaimed on demand."""

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Reclaim up to `num_pages` unheld cached pages, least recently used leaves first."""

    @abstractmethod
    def is_cached(self, page: int) -> bool:
        """Whether the page is indexed by the cache."""

    def can_allocate(self, num_pages: int) -> bool:
        """Whether `allocate(num_pages)` can succeed, counting pages eviction would reclaim."""
        return num_pages <= self.pool.num_free + self.num_evictable()

    def allocate(self, num_pages: int) -> list[int]:
        """Fresh pages held once by the caller, evicting unheld cached pages if the free list is short."""
        assert self.can_allocate(num_pages), "allocate() without can_allocate()"
        shortfall = num_pages - self.pool.num_free
        if shortfall > 0:
            self.evict(shortfall)
        return self.pool.allocate(num_pages)

    def admit(self, tokens: Sequence[int], salt: Salt) -> list[int] | None:
        """Give `tokens` a page table as the scheduler does in one go (match all but the last token, claim,
        allocate the rest, index the full pages); None, with nothing changed, if the pool cannot."""
        hit = self.match(tokens[: len(tokens) - 1], salt)
        claimed = 1 if hit.partial else 0
        needed = pages_for(len(tokens), self.block_size) - len(hit.pages) - claimed
        if not self.can_allocate(needed + claimed):  # the partial page counts as evictable until claimed
            self.release(hit.pages)
            return None
        pages = hit.pages + ([self.claim(hit.partial)] if hit.partial else []) + self.allocate(needed)
        return self.insert(tokens, pages, salt)

    def release(self, pages: list[int]) -> None:
        """Drop a sequence's hold on its pages; uncached pages that nobody holds become free."""
        unheld = self.pool.release(pages)
        self.pool.free([p for p in unheld if not self.is_cached(p)])

    @property
    def num_cached(self) -> int:
        """Pages not free that no sequence holds (kept for future hits)."""
        return self.pool.num_pages - self.pool.num_free - self.num_in_use

    @property
    def num_in_use(self) -> int:
        """Pages held by at least one live sequence."""
        return self.pool.num_held

    def check_integrity(self, page_tables: Sequence[Sequence[int]]) -> None:
        """Raise AssertionError unless the pool, the holders and the index agree exactly."""
        pool = self.pool
        holders = Counter(p for table in page_tables for p in table)
        for page in range(pool.num_pages):
            refs = pool.refcounts[page]
            assert refs >= 0, f"page {page} has negative refcount {refs}"
            assert refs == holders.get(page, 0), (
                f"page {page}: refcount {refs} but {holders.get(page, 0)} holders"
            )
            if pool.is_free(page):
                assert refs == 0 and not self.is_cached(page), f"free page {page} is held or cached"
            else:
                assert refs > 0 or self.is_cached(page), f"page {page} is neither free, held nor cached"
        for table in page_tables:
            assert len(set(table)) == len(table), f"a page table holds a page twice: {table}"
        held = sum(1 for r in pool.refcounts if r > 0)
        assert held == pool.num_held, f"pool counts {pool.num_held} held pages, refcounts say {held}"
        cached = sum(1 for p in range(pool.num_pages) if self.is_cached(p) and pool.refcounts[p] == 0)
        assert pool.num_free + cached + held == pool.num_pages, "free + cached + in use != total"
        self._check_index()

    @abstractmethod
    def _check_index(self) -> None:
        """Implementation-specific consistency of the cache's own index."""
