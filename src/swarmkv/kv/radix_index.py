"""A token-keyed radix tree over KV pages: a pure prefix index that never allocates, retains or frees.

One node per page; a node's key is the tokens its page holds, so a path from a salt's root spells a prefix.
Inner nodes are full pages. A leaf may be a partial page (fewer than `page_size` tokens): the unfinished last
page of a request that stopped running (a paused agent turn, a preempted request), which the next request
continuing those tokens can claim. The index reads the pool's refcounts to know which leaves are unheld,
and hands the pages it drops back to its caller, the KV cache manager, which owns the free list.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from swarmkv.kv.page_pool import PagePool

Salt = str | None
PageKey = tuple[int, ...]


@dataclass(frozen=True)
class PartialHit:
    """A cached, partly filled page whose first `num_tokens` slots hold KV a request can continue from;
    `whole` when those are all of its tokens, so the request may take the page itself."""

    page: int
    num_tokens: int
    whole: bool = True


@dataclass(eq=False)
class _Node:
    key: PageKey
    page: int | None  # None only for a salt's root
    parent: _Node | None
    salt: Salt = None
    children: dict[PageKey, _Node] = field(default_factory=dict)
    last_access: int = 0


class RadixIndex:
    """Per-salt trees of pages; LRU eviction of unheld leaves, so a head many requests share goes last."""

    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self._roots: dict[Salt, _Node] = {}
        self._node_of_page: dict[int, _Node] = {}
        self._clock = itertools.count(1)
        # Eviction candidates, oldest first. Entries go stale (node held again, touched, gone) and are skipped
        # when popped; every unheld leaf has one entry carrying its current last_access.
        self._heap: list[tuple[int, int, _Node]] = []

    @property
    def num_roots(self) -> int:
        """Salts with at least one cached page (empty roots are dropped at once)."""
        return len(self._roots)

    @property
    def num_pages(self) -> int:
        """Pages the index holds, held by a request or not."""
        return len(self._node_of_page)

    def lookup(self, tokens: Sequence[int], salt: Salt) -> tuple[list[int], PartialHit | None]:
        """Full pages of the longest cached prefix of `tokens`, and the partial page continuing it furthest.
        Changes nothing."""
        node = self._roots.get(salt)
        if node is None:
            return [], None
        size = self.page_size
        pages: list[int] = []
        for start in range(0, len(tokens) - size + 1, size):
            child = node.children.get(tuple(tokens[start : start + size]))
            if child is None:
                break
            assert child.page is not None
            pages.append(child.page)
            node = child
        return pages, self._best_partial(node, tokens[len(pages) * size :])

    def _best_partial(self, node: _Node, rest: Sequence[int]) -> PartialHit | None:
        """The child sharing the most leading tokens with `rest` (shorter than a page, or diverging from
        every full child); on a tie, a partial child `rest` continues whole, which can be taken rather
        than copied. A full child is only ever copied: its last slots are someone else's tokens."""
        best: PartialHit | None = None
        for key, child in node.children.items():
            common = 0
            for a, b in zip(key, rest, strict=False):
                if a != b:
                    break
                common += 1
            whole = common == len(key) < self.page_size
            if common and (best is None or (common, whole) > (best.num_tokens, best.whole)):
                assert child.page is not None
                best = PartialHit(child.page, common, whole)
        return best

    def touch(self, pages: Iterable[int]) -> None:
        """Mark cached pages as just used (a request took them)."""
        now = next(self._clock)
        for page in pages:
            self._node_of_page[page].last_access = now

    def insert(self, salt: Salt, parent_page: int | None, key: PageKey, page: int) -> int:
        """Index `page` holding `key` under `parent_page` (None: the salt's root). Returns the page the tree
        maps that prefix to: `page`, or the page that held it already (then `page` is not indexed)."""
        parent = self._roots.get(salt) if parent_page is None else self._node_of_page[parent_page]
        if parent is None:
            parent = self._roots[salt] = _Node(key=(), page=None, parent=None, salt=salt)
        child = parent.children.get(key)
        if child is not None:
            assert child.page is not None
            return child.page
        assert page not in self._node_of_page, f"page {page} is indexed under another prefix"
        child = _Node(key=key, page=page, parent=parent, last_access=next(self._clock))
        parent.children[key] = child
        self._node_of_page[page] = child
        return page

    def detach(self, page: int) -> None:
        """Take a partial leaf out of the tree: its claimer will write past its tokens."""
        node = self._node_of_page.pop(page)
        assert node.parent is not None and len(node.key) < self.page_size and not node.children
        self._unlink(node)

    def offer(self, page: int) -> None:
        """`page` just became unheld: queue it for eviction if it is a leaf."""
        self._offer(self._node_of_page[page])

    def evict(self, num_pages: int) -> list[int]:
        """Drop up to `num_pages` unheld leaves, oldest first; a parent becomes a candidate once it is a leaf.
        Returns the dropped pages, which are now the caller's to free."""
        dropped: list[int] = []
        while self._heap and len(dropped) < num_pages:
            last_access, _, node = heapq.heappop(self._heap)
            if not self._is_candidate(node, last_access):
                continue
            assert node.page is not None
            del self._node_of_page[node.page]
            dropped.append(node.page)
            self._unlink(node)
        return dropped

    def _unlink(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        if parent.page is not None:
            self._offer(parent)
        elif not parent.children:
            del self._roots[parent.salt]

    def _offer(self, node: _Node) -> None:
        if not self._is_evictable(node):
            return
        heapq.heappush(self._heap, (node.last_access, id(node), node))
        if len(self._heap) > 2 * len(self._node_of_page) + 64:  # mostly stale: rebuild from the live set
            self._heap = [
                (n.last_access, id(n), n) for n in self._node_of_page.values() if self._is_evictable(n)
            ]
            heapq.heapify(self._heap)

    def _is_candidate(self, node: _Node, last_access: int) -> bool:
        live = node.page is not None and self._node_of_page.get(node.page) is node
        return live and node.last_access == last_access and self._is_evictable(node)

    def _is_evictable(self, node: _Node) -> bool:
        return not node.children and node.page is not None and self.pool.refcounts[node.page] == 0

    def is_cached(self, page: int) -> bool:
        """Whether a node of the tree owns this page."""
        return page in self._node_of_page

    def is_full(self, page: int) -> bool:
        """Whether `page` is indexed as a full page (one every request with its prefix may share)."""
        node = self._node_of_page.get(page)
        return node is not None and len(node.key) == self.page_size

    def parent_page(self, page: int) -> int | None:
        """The page indexed before `page` on its path (None under a root)."""
        parent = self._node_of_page[page].parent
        assert parent is not None
        return parent.page

    def check(self) -> None:
        """Raise AssertionError unless the tree, the page map, the pool and the eviction queue agree."""
        seen: set[int] = set()
        for salt, root in self._roots.items():
            assert root.children, f"the root of salt {salt!r} is empty but kept"
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node and child.key == key, "child/parent links disagree"
                full = len(key) == self.page_size
                assert full or (0 < len(key) < self.page_size and not child.children), f"bad node key {key}"
                assert child.page is not None and child.page not in seen, f"page {child.page} indexed twice"
                assert self._node_of_page.get(child.page) is child, f"page {child.page} map is stale"
                assert not self.pool.is_free(child.page), f"cached page {child.page} is on the free list"
                refs = self.pool.refcounts[child.page]
                assert full or refs == 0, f"partial page {child.page} is in the index and held {refs} times"
                if node.page is not None and refs > 0:
                    assert self.pool.refcounts[node.page] > 0, (
                        f"held page {child.page} under an unheld parent"
                    )
                seen.add(child.page)
                stack.append(child)
        assert seen == set(self._node_of_page), "nodes unreachable from any root"
        queued = {(last, key) for last, key, node in self._heap if self._is_candidate(node, last)}
        for node in self._node_of_page.values():
            if self._is_evictable(node):
                assert (node.last_access, id(node)) in queued, f"unheld leaf page {node.page} is not queued"
