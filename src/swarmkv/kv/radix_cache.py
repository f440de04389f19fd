"""A token-keyed radix tree of KV pages: one node per page, children keyed by the page's tokens.

Inner nodes are full pages. A leaf may be a partial page (fewer than `block_size` tokens): the unfinished last
page of a sequence that stopped running (a paused agent turn, a preempted request). The next request that
continues those tokens claims the page and writes on past them, so a paused turn keeps all of its KV.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from swarmkv.kv.page_pool import PagePool
from swarmkv.kv.prefix_cache import PartialHit, PrefixCache, PrefixMatch, Salt

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
        # Eviction candidates, oldest first. Entries go stale (node held again, touched, gone) and are skipped
        # when popped; every unheld leaf has one entry carrying its current last_access.
        self._heap: list[tuple[int, int, _Node]] = []

    def _blocks(self, tokens: Sequence[int], num_blocks: int) -> list[BlockKey]:
        bs = self.block_size
        return [tuple(tokens[i * bs : (i + 1) * bs]) for i in range(num_blocks)]

    def match(self, tokens: Sequence[int], salt: Salt) -> PrefixMatch:
        """Full pages of the longest cached prefix, retained and marked recently used, plus the partial
        page that continues it furthest (not retained: `claim` takes it)."""
        node = self._roots.get(salt)
        if node is None:
            return PrefixMatch()
        now = next(self._clock)
        pages: list[int] = []
        for key in self._blocks(tokens, len(tokens) // self.block_size):
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = now
            assert child.page is not None
            pages.append(child.page)
            node = child
        self.pool.retain(pages)
        return PrefixMatch(pages, self._best_partial(node, tokens[len(pages) * self.block_size :]))

    def _best_partial(self, node: _Node, rest: Sequence[int]) -> PartialHit | None:
        best: PartialHit | None = None
        for key, child in node.children.items():
            if len(key) == self.block_size:
                continue
            common = 0
            for a, b in zip(key, rest, strict=False):
                if a != b:
                    break
                common += 1
            if common and (best is None or common > best.num_tokens):
                assert child.page is not None
                best = PartialHit(child.page, common)
        return best

    def claim(self, hit: PartialHit) -> int:
        """Detach a partial page from the tree and hand it to the caller, held once."""
        node = self._node_of_page[hit.page]
        assert node.parent is not None and len(node.key) < self.block_size and not node.children
        self.pool.retain([hit.page])
        del node.parent.children[node.key]
        del self._node_of_page[hit.page]
        self._offer(node.parent)
        return hit.page

    def insert(self, tokens: Sequence[int], pages: list[int], salt: Salt, partial: bool = False) -> list[int]:
        """Index the full pages (and with `partial` the last, partly filled one); where the tree already
        holds a block, swap the caller onto the tree's page."""
        bs = self.block_size
        num_full = min(len(pages), len(tokens) // bs)
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = _Node(key=(), page=None, parent=None)
        now = next(self._clock)
        result = list(pages)
        keys = self._blocks(tokens, num_full)
        if partial and len(pages) > num_full and len(tokens) > num_full * bs:
            keys.append(tuple(tokens[num_full * bs : (num_full + 1) * bs]))
        for i, key in enumerate(keys):
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
        evicted = 0
        while self._heap and evicted < num_pages:
            last_access, _, node = heapq.heappop(self._heap)
            if not self._is_candidate(node, last_access):
                continue
            parent = node.parent
            assert parent is not None and node.page is not None
            del parent.children[node.key]
            del self._node_of_page[node.page]
            self.pool.free([node.page])
            evicted += 1
            self._offer(parent)
        self._drop_empty_roots()
        self.num_evictions += evicted
        return evicted

    def release(self, pages: list[int]) -> None:
        """Drop a sequence's hold; unheld cached leaves become eviction candidates, uncached pages go free."""
        uncached = []
        for page in self.pool.release(pages):
            node = self._node_of_page.get(page)
            if node is None:
                uncached.append(page)
            else:
                self._offer(node)
        self.pool.free(uncached)

    def _offer(self, node: _Node) -> None:
        """Queue `node` for eviction if it is an unheld leaf (roots never are)."""
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
                full = len(key) == self.block_size
                assert full or (0 < len(key) < self.block_size and not child.children), f"bad node key {key}"
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
        queued = {(last, key) for last, key, node in self._heap if self._is_candidate(node, last)}
        for node in self._node_of_page.values():
            if self._is_evictable(node):
                assert (node.last_access, id(node)) in queued, f"unheld leaf page {node.page} is not queued"
