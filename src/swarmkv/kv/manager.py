"""KVCacheManager: owns every request's page table over the page pool and the radix index.

The verbs follow vLLM v1's KV cache manager:
- `lookup` finds the cached prefix of a request's tokens and changes nothing;
- `allocate` takes references on a hit, claims or copies its partial page, evicts and allocates, all or nothing;
- `commit` indexes the pages that became full, and never rewrites a page table entry;
- `free` releases a request's pages, optionally leaving its partly filled last page cached.
Page tables are append-only, so a runner can keep them resident. A partial page is taken by a request that
continues all of its tokens; one that continues only some of them gets a copy (through `copy_page`, the
engine's KV tensors), so the page stays cached for the request that continues it whole, such as the paused
agent's next turn. A page two requests computed in a cold
race (or recomputed because a prompt ends on a page boundary) stays in the later one's table, private, and
is freed when that request ends; that request also holds the indexed copy, under which its later pages are
indexed. Without prefix caching (the per-slot layout) the same manager keeps no index at all.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from swarmkv.kv.page_pool import PagePool, pages_for
from swarmkv.kv.radix_index import PartialHit, RadixIndex, Salt


class KVRequest(Protocol):
    """What the manager reads of a request: its id, its salt, its tokens and how many have KV."""

    @property
    def request_id(self) -> str: ...

    @property
    def cache_salt(self) -> Salt: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...


@dataclass(frozen=True)
class Hit:
    """A cached prefix: full pages, and possibly a partial page to continue in. Holds no references."""

    pages: tuple[int, ...] = ()
    partial: PartialHit | None = None
    num_tokens: int = 0


NO_HIT = Hit()


@dataclass
class _Table:
    salt: Salt
    pages: list[int] = field(default_factory=list)
    # The index's pages for our first len(path) pages, a path from the salt's root. path[i] is pages[i]
    # unless our page duplicates one the index held already; we then hold that one too (in `shadow`), so
    # that our later pages index under it and it cannot be evicted from under them.
    path: list[int] = field(default_factory=list)
    shadow: list[int] = field(default_factory=list)


class KVCacheManager:
    """Request -> pages over a `PagePool`; with `prefix_caching`, full pages are shared through a radix index."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        prefix_caching: bool = True,
        copy_page: Callable[[int, int], None] | None = None,
    ) -> None:
        """`copy_page(src, dst)` copies a page's KV; without it (bookkeeping only) copies are not made."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.pool = PagePool(num_pages)
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.index = RadixIndex(self.pool, page_size)
        self._copy_page = copy_page
        self._tables: dict[str, _Table] = {}
        self.num_evictions = 0

    # Reading.

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self.pool.num_pages

    @property
    def num_free(self) -> int:
        """Pages on the free list."""
        return self.pool.num_free

    @property
    def num_in_use(self) -> int:
        """Pages held by at least one request."""
        return self.pool.num_held

    @property
    def num_cached(self) -> int:
        """Indexed pages no request holds: kept for future hits, reclaimed on demand."""
        return self.pool.num_pages - self.pool.num_free - self.pool.num_held

    def page_table(self, request_id: str) -> Sequence[int]:
        """The request's pages, in token order (empty if it holds none). Read-only."""
        table = self._tables.get(request_id)
        return table.pages if table else ()

    def holds_pages(self, request_id: str) -> bool:
        """Whether the request has a page table."""
        return request_id in self._tables

    def lookup(self, tokens: Sequence[int], salt: Salt) -> Hit:
        """The longest cached prefix of `tokens` under `salt`; no references taken, nothing changed."""
        if not self.prefix_caching:
            return NO_HIT
        pages, partial = self.index.lookup(tokens, salt)
        if partial is not None and not partial.whole and partial.num_tokens < self.page_size // 2:
            partial = None  # a copy must spare at least half a page of compute to be worth a page copy
        num_tokens = len(pages) * self.page_size + (partial.num_tokens if partial else 0)
        return Hit(tuple(pages), partial, num_tokens)

    def num_new_pages(self, request: KVRequest, hit: Hit, num_new_tokens: int) -> int:
        """Pages `allocate` would take from the pool (or from eviction) for this call."""
        table = self._tables.get(request.request_id)
        if table is None:
            have, base = len(hit.pages) + (hit.partial is not None and hit.partial.whole), hit.num_tokens
        else:
            have, base = len(table.pages), request.num_computed_tokens
        return max(0, pages_for(base + num_new_tokens, self.page_size) - have)

    def can_allocate(self, request: KVRequest, hit: Hit, num_new_tokens: int) -> bool:
        """Whether `allocate` with these arguments would succeed."""
        # Hit pages nobody holds are evictable now, but taking them removes them from the evictable set;
        # a partial page is always unheld, and is claimed out of it or held there until copied.
        taken = sum(1 for p in hit.pages if self.pool.refcounts[p] == 0) + (hit.partial is not None)
        available = self.pool.num_free + self.num_cached - taken
        return self.num_new_pages(request, hit, num_new_tokens) <= available

    # Changing.

    def allocate(self, request: KVRequest, hit: Hit, num_new_tokens: int) -> list[int] | None:
        """Give the request KV for `num_new_tokens` tokens past its computed ones (past `hit` for a request
        without pages yet). Returns the pages appended to its table (the hit's included), or None with
        nothing changed if the pool cannot, even after evicting every unheld cached page."""
        rid = request.request_id
        assert hit is NO_HIT or rid not in self._tables, "a hit is only for a request without pages"
        if not self.can_allocate(request, hit, num_new_tokens):
            return None
        needed = self.num_new_pages(request, hit, num_new_tokens)
        table = self._tables.get(rid)
        appended: list[int] = []
        copy_from = hit.partial.page if hit.partial is not None and not hit.partial.whole else None
        if table is None:
            table = self._tables[rid] = _Table(request.cache_salt)
            appended += hit.pages
            self.pool.retain(list(hit.pages))
            self.index.touch(hit.pages)
            table.path = list(hit.pages)
            if hit.partial is not None and hit.partial.whole:
                self.index.detach(hit.partial.page)
                self.pool.retain([hit.partial.page])
                appended.append(hit.partial.page)
            elif copy_from is not None:
                self.pool.retain([copy_from])  # not evictable until copied below
        shortfall = needed - self.pool.num_free
        if shortfall > 0:
            evicted = self.evict(shortfall)
            assert evicted == shortfall, "the index could not evict what it counted as evictable"
        new_pages = self.pool.allocate(needed)
        if copy_from is not None:
            if self._copy_page is not None:
                self._copy_page(copy_from, new_pages[0])
            self.pool.release([copy_from])
            self.index.touch([copy_from])
            self.index.offer(copy_from)
        appended += new_pages
        table.pages += appended
        return appended

    def evict(self, num_pages: int) -> int:
        """Return up to `num_pages` unheld cached pages to the free list, least recently used leaves first."""
        evicted = self.index.evict(num_pages)
        self.pool.free(evicted)
        self.num_evictions += len(evicted)
        return len(evicted)

    def commit(self, request: KVRequest, num_computed_tokens: int) -> None:
        """The request's first `num_computed_tokens` tokens now have KV: index the pages that became full."""
        table = self._tables[request.request_id]
        num_full = min(num_computed_tokens // self.page_size, len(table.pages))
        if not self.prefix_caching or len(table.path) >= num_full:
            return
        size, tokens = self.page_size, request.token_ids
        while len(table.path) < num_full:
            i = len(table.path)
            parent = table.path[i - 1] if i else None
            key = tuple(tokens[i * size : (i + 1) * size])
            indexed = self.index.insert(table.salt, parent, key, table.pages[i])
            if indexed != table.pages[i]:  # computed twice: ours stays private, we hold the index's copy
                self.pool.retain([indexed])
                table.shadow.append(indexed)
            table.path.append(indexed)

    def free(self, request: KVRequest, keep_partial: bool = True) -> None:
        """Release the request's pages. With `keep_partial` (a request that stopped running), its computed
        KV stays cached, the partly filled last page included, for a request that continues its tokens."""
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        computed = request.num_computed_tokens
        self.commit(request, computed)
        full, rest = divmod(computed, self.page_size)
        if (
            keep_partial
            and self.prefix_caching
            and rest
            and len(table.path) == full
            and len(table.pages) > full
        ):
            key = tuple(request.token_ids[full * self.page_size : computed])
            parent = table.path[full - 1] if full else None
            # If an identical partial page is cached already, ours is not indexed and is freed below.
            self.index.insert(table.salt, parent, key, table.pages[full])
        del self._tables[rid]
        uncached = []
        for page in self.pool.release(table.pages + table.shadow):
            if self.index.is_cached(page):
                self.index.offer(page)
            else:
                uncached.append(page)
        self.pool.free(uncached)

    # Checking.

    def check_integrity(self) -> None:
        """Raise AssertionError unless pool, page tables and index agree, and sharing is safe:
        refcounts equal holders; free + cached + held == total; every page two requests hold is a full
        indexed page; a partial leaf in the index is unheld; no page is both free and indexed."""
        pool = self.pool
        holders = Counter(p for table in self._tables.values() for p in table.pages + table.shadow)
        for page in range(pool.num_pages):
            refs = pool.refcounts[page]
            assert refs == holders.get(page, 0), f"page {page}: refcount {refs} but {holders[page]} holders"
            cached = self.index.is_cached(page)
            if pool.is_free(page):
                assert refs == 0 and not cached, f"free page {page} is held or indexed"
            else:
                assert refs > 0 or cached, f"page {page} is neither free, held nor indexed"
            if refs > 1:
                assert self.index.is_full(page), f"page {page} is held {refs} times but is not a full page"
        assert sum(1 for r in pool.refcounts if r) == pool.num_held, "pool's held count disagrees"
        for rid, table in self._tables.items():
            assert len(set(table.pages)) == len(table.pages), f"{rid} holds a page twice"
            parent: int | None = None
            for own, page in zip(table.pages, table.path, strict=False):
                assert self.index.is_full(page), f"{rid}: path page {page} is not in the index"
                assert self.index.parent_page(page) == parent, f"{rid}: page {page} is off its path"
                assert own == page or page in table.shadow, f"{rid}: holds neither its page nor the index's"
                parent = page
        if not self.prefix_caching:
            assert self.index.num_pages == 0, "the per-slot layout indexes nothing"
        self.index.check()

    def check_writable(self, request_id: str, start: int, end: int) -> None:
        """Raise AssertionError unless the pages holding positions [start, end) of the request are held by
        it alone and are not in the index: a step may write only there."""
        pages = self._tables[request_id].pages
        for i in range(start // self.page_size, pages_for(end, self.page_size)):
            page = pages[i]
            refs = self.pool.refcounts[page]
            assert refs == 1, f"{request_id} writes page {page}, which {refs} requests hold"
            assert not self.index.is_cached(page), f"{request_id} writes page {page}, which is indexed"
