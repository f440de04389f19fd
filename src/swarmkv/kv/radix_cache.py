"""A token-keyed radix tree of full KV pages: one node per page, children keyed by the page's tokens."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from swarmkv.kv.page_pool import PagePool
from swarmkv.kv.prefix_cache import PrefixCache, Salt

BlockKey = tuple[int, ...]


@dataclass(eq=False)
class _Node:
    key: BlockKey
    page: int | None  # None only for a salt's root
    parent: _Node | None
    children: dict[BlockKey, _Node] = field(default_factory=dict)
    last_access: int = 0


class RadixCache(PrefixCache):
    """Shares every full page whose token prefix (and cache salt) is identical; evicts unheld leaves, LRU."""

    def __init__(self, pool: PagePool, block_size: int) -> None:
        super().__init__(pool, block_size)
        self._roots: dict[Salt, _Node] = {}
        self._node_of_page: dict[int, _Node] = {}
        self._clock = itertools.count(1)

    def _blocks(self, tokens: Sequence[int], num_blocks: int) -> list[BlockKey]:
        bs = self.block_size
        return [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(num_blocks)]

    def match(self, tokens: Sequence[int], salt: Salt) -> list[int]:
        """Pages of the longest cached page-aligned prefix, retained for the caller and marked recently used."""
        node = self._roots.get(salt)
        pages: list[int] = []
        if node is None:
            return pages
        now = next(self._clock)
        for key in self._blocks(tokens, len(tokens) // self.block_size):
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = now
            assert child.page is not None
            pages.append(child.page)
            node = child
        self.pool.retain(pages)
        return pages

    def insert(self, tokens: Sequence[int], pages: list[int], salt: Salt) -> list[int]:
        """Index the full pages; where the tree already holds a block, swap the caller onto the tree's page."""
        num_full = min(len(pages), len(tokens) // self.block_size)
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = _Node(key=(), page=None, parent=None)
        now = next(self._clock)
        result = list(pages)
        for i, key in enumerate(self._blocks(tokens, num_full)):
            child = node.children.get(key)
            if child is None:
                assert pages[i] not in self._node_of_page, f"page {pages[i]} is cached under another prefix"
                child = _Node(key=key, page=pages[i], parent=node)
                node.children[key] = child
                self._node_of_page[pages[i]] = child
            elif child.page != pages[i]:
                # Two sequences computed the same block; keep one copy and free the duplicate.
                assert child.page is not None
                self.pool.retain([child.page])
                self.release([pages[i]])
                result[i] = child.page
            child.last_access = now
            node = child
        return result

    def num_evictable(self) -> int:
        """Every cached page nobody holds: holders keep whole root paths, so unheld subtrees are all unheld."""
        return self.pool.num_pages - self.pool.num_free - self.pool.num_held

    def evict(self, num_pages: int) -> int:
        """Free up to `num_pages` unheld leaves, oldest first; a parent becomes a candidate once it is a leaf."""
        heap = [(n.last_access, id(n), n) for n in self._node_of_page.values() if self._is_evictable(n)]
        heapq.heapify(heap)
        evicted = 0
        while heap and evicted < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            assert parent is not None and node.page is not None
            del parent.children[node.key]
            del self._node_of_page[node.page]
            self.pool.free([node.page])
            evicted += 1
            if parent.page is not None and self._is_evictable(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        self._drop_empty_roots()
        self.num_evictions += evicted
        return evicted

    def _is_evictable(self, node: _Node) -> bool:
        return not node.children and node.page is not None and self.pool.refcounts[node.page] == 0

    def _drop_empty_roots(self) -> None:
        for salt in [s for s, root in self._roots.items() if not root.children]:
            del self._roots[salt]

    def is_cached(self, page: int) -> bool:
        """Whether a tree node owns this page."""
        return page in self._node_of_page

    def _check_index(self) -> None:
        seen: set[int] = set()
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node and child.key == key, "child/parent links disagree"
                assert len(key) == self.block_size, f"node key holds {len(key)} tokens"
                assert child.page is not None and child.page not in seen, f"page {child.page} indexed twice"
                assert self._node_of_page.get(child.page) is child, f"page {child.page} map is stale"
                assert not self.pool.is_free(child.page), f"cached page {child.page} is on the free list"
                if node.page is not None and self.pool.refcounts[child.page] > 0:
                    assert self.pool.refcounts[node.page] > 0, (
                        f"held page {child.page} under an unheld parent"
                    )
                seen.add(child.page)
                stack.append(child)
        assert seen == set(self._node_of_page), "nodes unreachable from any root"
