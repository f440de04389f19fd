"""A token-keyed radix tree over KV pages: a pure prefix index that never allocates, retains or frees.

One node per page; a node's key is the tokens its page holds, so a path from a salt's root spells a prefix.
Inner nodes are full pages. A leaf may be a partial page (fewer than `page_size` tokens): the unfinished last
page of a request that stopped running (a paused agent turn, a preempted request), which the next request
continuing those tokens can claim. The index reads the pool's refcounts to know which leaves are unheld,
and hands the pages it drops back to its caller, the KV cache manager, which owns both free lists.

A node's KV is on the device (`page`) or, once evicted to the host tier, in a host page (`host`): the node
stays in the tree and a later hit loads it back. Device nodes form the top of every path (a node goes to
the host only when none of its children is on the device, and comes back only under a device parent), so
a hit is some device pages followed by some host pages.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from swarmkv.kv.page_pool import PagePool

Salt = str | None
PageKey = tuple[int, ...]


@dataclass(frozen=True)
class PartialHit:
    """A cached, partly filled page whose first `num_tokens` slots hold KV a request can continue from;
    `whole` when those are all of its tokens, so the request may take the page itself. `page` is a host
    page when `on_host`."""

    page: int
    num_tokens: int
    whole: bool = True
    on_host: bool = False


@dataclass(eq=False)
class Node:
    """One cached page of the tree; callers hold nodes only as opaque handles (retention keys)."""

    key: PageKey
    page: int | None  # the device page; None for a salt's root and for a node on the host
    parent: Node | None
    salt: Salt = None
    host: int | None = None  # the host page while the KV is offloaded
    children: dict[PageKey, Node] = field(default_factory=dict)
    last_access: int = 0
    marks: Any = (
        None  # the retention policy's record of this page (who used it, who reaches it): never read here
    )


EvictionKey = Callable[[Node], tuple[Any, ...]]


@dataclass(frozen=True)
class Eviction:
    """What one `evict` did: device pages it took back (each either moved to `host` or dropped), and host
    pages dropped along with dropped device nodes."""

    moved: list[tuple[int, int]] = field(default_factory=list)  # (device page, host page)
    dropped: list[int] = field(default_factory=list)  # device pages whose KV is gone
    dropped_host: list[int] = field(default_factory=list)

    @property
    def device_pages(self) -> list[int]:
        """Every device page this eviction returned."""
        return [page for page, _ in self.moved] + self.dropped


class RadixIndex:
    """Per-salt trees of pages; eviction of unheld leaves in a caller's order (LRU by default)."""

    def __init__(self, pool: PagePool, page_size: int) -> None:
        self.pool = pool
        self.page_size = page_size
        self._roots: dict[Salt, Node] = {}
        self._node_of_page: dict[int, Node] = {}
        self._node_of_host: dict[int, Node] = {}
        # Device nodes with no child on the device, kept as pages come and go: eviction's candidates are
        # the unheld ones among them, so it never scans the whole tree.
        self._device_leaves: dict[int, Node] = {}
        self.version = 0  # bumped by every change to the tree's nodes or tiers (not by `touch`)
        self._clock = itertools.count(1)
        self._superseded_hosts: list[int] = []  # host copies a fresh device page replaced (see insert)

    @property
    def num_roots(self) -> int:
        """Salts with at least one cached page (empty roots are dropped at once)."""
        return len(self._roots)

    @property
    def num_pages(self) -> int:
        """Device pages the index holds, held by a request or not."""
        return len(self._node_of_page)

    @property
    def num_host_pages(self) -> int:
        """Host pages the index holds."""
        return len(self._node_of_host)

    def lookup(
        self, tokens: Sequence[int], salt: Salt, keys: Sequence[PageKey] | None = None
    ) -> tuple[list[int], list[int], PartialHit | None]:
        """Device pages, then host pages, of the longest cached prefix of `tokens`, and the partial page
        continuing it furthest (`keys`: the page keys of `tokens`' full pages, or more, when the caller
        keeps them). Changes nothing."""
        pages: list[int] = []
        host_pages: list[int] = []
        root = self._roots.get(salt)
        if root is None:
            return pages, host_pages, None
        node = root
        for node in self._walk(root, tokens, keys):  # node ends as the deepest match
            if node.page is not None:
                assert not host_pages, "a device page under a host page"
                pages.append(node.page)
            else:
                assert node.host is not None
                host_pages.append(node.host)
        done = (len(pages) + len(host_pages)) * self.page_size
        return pages, host_pages, self._best_partial(node, tokens[done:])

    def path(self, tokens: Sequence[int], salt: Salt) -> list[Node]:
        """The nodes (either tier) of the longest cached prefix of `tokens`, with the partial page that
        continues it furthest. Changes nothing."""
        root = self._roots.get(salt)
        if root is None:
            return []
        nodes = list(self._walk(root, tokens))
        partial = self._best_partial(nodes[-1] if nodes else root, tokens[len(nodes) * self.page_size :])
        if partial is not None:
            nodes.append(
                self._node_of_host[partial.page] if partial.on_host else self._node_of_page[partial.page]
            )
        return nodes

    def _walk(
        self, node: Node, tokens: Sequence[int], keys: Sequence[PageKey] | None = None
    ) -> Iterator[Node]:
        size = self.page_size
        for i, start in enumerate(range(0, len(tokens) - size + 1, size)):
            child = node.children.get(keys[i] if keys is not None else tuple(tokens[start : start + size]))
            if child is None:
                return
            yield child
            node = child

    def _best_partial(self, node: Node, rest: Sequence[int]) -> PartialHit | None:
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
                on_host = child.page is None
                page = child.host if on_host else child.page
                assert page is not None
                best = PartialHit(page, common, whole, on_host)
        return best

    def node(self, page: int) -> Node:
        """The node of an indexed device page."""
        return self._node_of_page[page]

    def touch(self, pages: Iterable[int]) -> None:
        """Mark cached pages as just used (a request took them)."""
        now = next(self._clock)
        for page in pages:
            self._node_of_page[page].last_access = now

    def insert(self, salt: Salt, parent_page: int | None, key: PageKey, page: int) -> int:
        """Index `page` holding `key` under `parent_page` (None: the salt's root). Returns the page the tree
        maps that prefix to: `page`, or the device page that held it already (then `page` is not indexed).
        A host copy of the same prefix is superseded: `page` takes its place and its host page is
        returned by `take_superseded_host`."""
        parent = self._roots.get(salt) if parent_page is None else self._node_of_page[parent_page]
        if parent is None:
            parent = self._roots[salt] = Node(key=(), page=None, parent=None, salt=salt)
        child = parent.children.get(key)
        if child is not None and child.page is not None:
            return child.page
        assert page not in self._node_of_page, f"page {page} is indexed under another prefix"
        if child is not None:  # the same tokens wait on the host: the fresh device copy replaces them
            assert child.host is not None
            del self._node_of_host[child.host]
            self._superseded_hosts.append(child.host)
            child.host = None
            child.last_access = next(self._clock)
        else:
            child = Node(key=key, page=None, parent=parent, last_access=next(self._clock))
            parent.children[key] = child
        self._to_device(child, page)
        return page

    def take_superseded_host(self) -> list[int]:
        """Host pages whose tokens a fresh device page replaced since the last call: the caller frees them."""
        hosts, self._superseded_hosts = self._superseded_hosts, []
        return hosts

    def detach(self, page: int) -> Node:
        """Take a partial leaf out of the tree: its claimer will write past its tokens."""
        node = self._node_of_page[page]
        assert node.parent is not None and len(node.key) < self.page_size and not node.children
        self._off_device(node)
        self._unlink(node)
        return node

    def evict(
        self,
        num_pages: int,
        order: EvictionKey | None = None,
        host_page: Callable[[], int | None] | None = None,
    ) -> Eviction:
        """Take back up to `num_pages` unheld device leaves (no child on the device), first by `order` (an
        extra key before last use), then least recently used; a parent becomes a candidate once it is such
        a leaf. Each goes to the host page `host_page()` gives, or is dropped with its host subtree."""
        key = order or (lambda node: ())
        refcounts = self.pool.refcounts
        heap = [
            (key(n), n.last_access, id(n), n)
            for page, n in self._device_leaves.items()
            if refcounts[page] == 0
        ]
        heapq.heapify(heap)
        result = Eviction()
        while heap and len(result.moved) + len(result.dropped) < num_pages:
            *_, node = heapq.heappop(heap)
            page = node.page
            assert page is not None
            # Before the node leaves the device: dropping a host leaf for room must not find it empty.
            host = host_page() if host_page is not None else None
            self._off_device(node)
            if host is not None:
                node.host = host
                self._node_of_host[host] = node
                result.moved.append((page, host))
            else:
                result.dropped.append(page)
                result.dropped_host.extend(self._drop_subtree(node))
                self._unlink(node)
            parent = node.parent
            if parent is not None and self._evictable(parent):
                heapq.heappush(heap, (key(parent), parent.last_access, id(parent), parent))
        return result

    def drop_host(self, num_pages: int, keep: frozenset[int] = frozenset()) -> list[int]:
        """Drop up to `num_pages` host leaves, least recently used first, never one in `keep`. Returns the
        host pages, now the caller's to free."""
        heap = [
            (n.last_access, id(n), n)
            for h, n in self._node_of_host.items()
            if not n.children and h not in keep
        ]
        heapq.heapify(heap)
        dropped: list[int] = []
        while heap and len(dropped) < num_pages:
            *_, node = heapq.heappop(heap)
            assert node.host is not None
            dropped.append(node.host)
            del self._node_of_host[node.host]
            node.host = None
            parent = node.parent
            self._unlink(node)
            if (
                parent is not None
                and parent.host is not None
                and not parent.children
                and parent.host not in keep
            ):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return dropped

    def load(self, host: int, page: int) -> None:
        """The KV of host page `host` now lives in device page `page` (the caller copied it)."""
        node = self._node_of_host.pop(host)
        assert node.parent is not None and (node.parent.page is not None or node.parent.parent is None), (
            "loading a host page under a parent that is not on the device"
        )
        node.host = None
        node.last_access = next(self._clock)
        self._to_device(node, page)

    def offload(self, pages: Sequence[int], host_page: Callable[[], int | None]) -> list[tuple[int, int]]:
        """Move these unheld device pages to host pages, leaves first (a request's tail, given in token
        order), while `host_page()` gives one. Returns the (device page, host page) moves."""
        moved: list[tuple[int, int]] = []
        for page in reversed(pages):
            node = self._node_of_page.get(page)
            if node is None or not self._evictable(node):
                break
            host = host_page()
            if host is None:
                break
            self._off_device(node)
            node.host = host
            self._node_of_host[host] = node
            moved.append((page, host))
        return moved

    def _to_device(self, node: Node, page: int) -> None:
        """The node's KV is now in device page `page`: it is a device leaf, and its parent no longer is."""
        node.page = page
        self.version += 1
        self._node_of_page[page] = node
        if all(child.page is None for child in node.children.values()):
            self._device_leaves[page] = node
        parent = node.parent
        if parent is not None and parent.page is not None:
            self._device_leaves.pop(parent.page, None)

    def _off_device(self, node: Node) -> None:
        """The node's device page goes (to the host, or with the node): its parent may become a leaf."""
        assert node.page is not None
        self.version += 1
        del self._node_of_page[node.page]
        self._device_leaves.pop(node.page, None)
        node.page = None
        parent = node.parent
        if (
            parent is not None
            and parent.page is not None
            and all(child.page is None for child in parent.children.values())
        ):
            self._device_leaves[parent.page] = parent

    def _drop_subtree(self, node: Node) -> list[int]:
        """Forget every host node under `node` (they hang from a node being dropped)."""
        hosts: list[int] = []
        self.version += 1
        stack = list(node.children.values())
        while stack:
            child = stack.pop()
            assert child.page is None and child.host is not None, "a device page under an evicted one"
            hosts.append(child.host)
            del self._node_of_host[child.host]
            child.host = None
            stack.extend(child.children.values())
        node.children.clear()
        return hosts

    def _unlink(self, node: Node) -> None:
        self.version += 1
        parent = node.parent
        assert parent is not None
        del parent.children[node.key]
        if parent.page is None and parent.host is None and not parent.children:
            del self._roots[parent.salt]

    def _evictable(self, node: Node) -> bool:
        return (
            node.page is not None
            and self.pool.refcounts[node.page] == 0
            and all(child.page is None for child in node.children.values())
        )

    def is_cached(self, page: int) -> bool:
        """Whether a node of the tree owns this device page."""
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

    def host_pages(self) -> set[int]:
        """Host pages the tree holds."""
        return set(self._node_of_host)

    def export(self, owners: Callable[[Node], list[str]] = lambda node: []) -> list[dict[str, Any]]:
        """Every node as plain data, parents before children: a snapshot for views and scripts. Changes nothing.

        Each record: `id`, `parent` (an earlier record's id; None on a salt's root), `salt` (its root's),
        `num_tokens` (0 on a root, `page_size` on a full page, fewer on a partial leaf), `page` and `host`
        (the device or host page; both None on a root), `holders` (page tables and pins holding the
        device page; 0 on the host and on a root) and `owners` (what `owners` says of the node: the KV manager
        passes its retention's sorted sessions that computed or reused it).
        """
        records: list[dict[str, Any]] = []
        stack: list[tuple[Node, int | None, Salt]] = [
            (root, None, salt) for salt, root in self._roots.items()
        ]
        while stack:  # iterative: a long prompt is a path thousands of pages deep
            node, parent_id, salt = stack.pop()
            node_id = len(records)
            records.append(
                {
                    "id": node_id,
                    "parent": parent_id,
                    "salt": salt,
                    "num_tokens": len(node.key),
                    "page": node.page,
                    "host": node.host,
                    "holders": self.pool.refcounts[node.page] if node.page is not None else 0,
                    "owners": owners(node),
                }
            )
            stack.extend((child, node_id, salt) for child in node.children.values())
        return records

    def check(self) -> None:
        """Raise AssertionError unless the tree, the page maps and the pool agree."""
        seen: set[int] = set()
        seen_host: set[int] = set()
        for salt, root in self._roots.items():
            assert root.children, f"the root of salt {salt!r} is empty but kept"
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node and child.key == key, "child/parent links disagree"
                full = len(key) == self.page_size
                assert full or (0 < len(key) < self.page_size and not child.children), f"bad node key {key}"
                if child.page is None:
                    assert child.host is not None and child.host not in seen_host, "host page lost or twice"
                    assert self._node_of_host.get(child.host) is child, f"host page {child.host} map is stale"
                    seen_host.add(child.host)
                    stack.append(child)
                    continue
                assert child.host is None, f"page {child.page} is on both tiers"
                assert node.parent is None or node.page is not None, (
                    f"device page {child.page} under a host page"
                )
                assert child.page not in seen, f"page {child.page} indexed twice"
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
        leaves = {
            page
            for page, node in self._node_of_page.items()
            if all(child.page is None for child in node.children.values())
        }
        assert leaves == set(self._device_leaves), "the device leaves kept disagree with the tree"
        assert all(self._device_leaves[page] is self._node_of_page[page] for page in leaves), "stale leaf"
        assert seen_host == set(self._node_of_host), "host nodes unreachable from any root"
