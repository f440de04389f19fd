"""The radix tree as a reader sees it: chains of single-child pages collapsed, small siblings aggregated.

`build_view(records, pinned, viewer)` turns `RadixIndex.export()` records (one per page, thousands of them)
into a few dozen view nodes, parents before children, each a JSON object. `viewer` (`tenants.py`) is who
asks: it sees its own roots only (an admin every tenant's), salts and sessions as its clients sent them.

- `id` (int), `parent` (an earlier node's id; None on a root), `kind`: "root" (one per cache salt),
  "pages" (a chain of pages where each but the last has exactly one child) or "aggregate" (the smaller
  children of one node, with everything under them).
- `salt`: the root's cache salt (None: the shared, unsalted tree); `tenant`: the tenant whose root it is
  (None: the one unnamed tenant, when the server has no key file).
- `start`: the token position of the node's first token; `tokens`: the tokens it holds (for an aggregate,
  all of its subtrees'); `span`: the token positions it covers when drawn (`tokens` for a chain, the
  longest merged subtree for an aggregate); `pages`: its pages.
- `holders`: the most page tables and pins holding any of its pages. A holder holds its page's whole root
  path, so along a chain this is the count on the first page, and the chain's last page may have fewer.
- `sessions`: sorted sessions that computed or reused any of its pages (at most 32 listed);
  `num_sessions`: how many there are in all.
- `tier`: "device", "host" (offloaded to host memory) or "mixed"; None on a root.
- `pinned`: whether a pin holds any of its pages. `aggregated`: children merged into an aggregate, else 0.
- `trunk`: true on each root's largest child: under a shared system prompt, the head the salt's requests share.

Children come largest subtree first. A node keeps its `MAX_CHILDREN` largest children; when it has two
or more beyond those, they become one aggregate ("N more leaves, T tokens").
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from swarmkv.server.tenants import ANONYMOUS, Tenant

MAX_CHILDREN = 8
MAX_SESSIONS_LISTED = 32


@dataclass
class _Summary:
    """What one view node says about the pages it stands for."""

    tokens: int = 0
    pages: int = 0
    holders: int = 0
    tiers: set[str] = field(default_factory=set)
    sessions: set[str] = field(default_factory=set)
    pinned: bool = False

    def add(self, record: dict[str, Any], pinned: frozenset[int]) -> None:
        """Fold in one page's record."""
        self.tokens += record["num_tokens"]
        self.pages += 1
        self.holders = max(self.holders, record["holders"])
        self.tiers.add("device" if record["page"] is not None else "host")
        self.sessions.update(record["owners"])
        self.pinned = self.pinned or record["page"] in pinned

    @property
    def tier(self) -> str:
        """One tier, or "mixed"."""
        return next(iter(self.tiers)) if len(self.tiers) == 1 else "mixed"


class _Tree:
    """The exported records with child lists and subtree sizes."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records
        self.children: list[list[int]] = [[] for _ in records]
        for record in records:
            if record["parent"] is not None:
                self.children[record["parent"]].append(record["id"])
        self.subtree_tokens = [r["num_tokens"] for r in records]
        self.subtree_span = [r["num_tokens"] for r in records]
        for record in reversed(records):  # children come after their parents
            parent = record["parent"]
            if parent is not None:
                self.subtree_tokens[parent] += self.subtree_tokens[record["id"]]
                self.subtree_span[parent] = max(
                    self.subtree_span[parent],
                    self.records[parent]["num_tokens"] + self.subtree_span[record["id"]],
                )
        for kids in self.children:
            kids.sort(key=lambda i: (-self.subtree_tokens[i], i))

    def chain(self, first: int) -> list[int]:
        """`first` and its single-child descendants, down to a leaf or a branch."""
        ids = [first]
        while len(self.children[ids[-1]]) == 1:
            ids.append(self.children[ids[-1]][0])
        return ids

    def subtree(self, top: int) -> Iterable[int]:
        """`top` and every node under it."""
        stack = [top]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(self.children[node])


@dataclass(frozen=True)
class _Work:
    """A view node still to emit: the chain starting at record `first`, or a ready `aggregate`."""

    parent: int
    start: int
    first: int | None = None
    trunk: bool = False
    aggregate: tuple[_Summary, int, int] | None = None  # (summary, span, children merged)


def build_view(
    records: list[dict[str, Any]], pinned: frozenset[int] = frozenset(), viewer: Tenant = ANONYMOUS
) -> list[dict[str, Any]]:
    """View nodes (see the module docstring) of `RadixIndex.export()` records that `viewer` may see;
    `pinned`: pinned device pages."""
    tree = _Tree(records)
    nodes: list[dict[str, Any]] = []
    work: list[_Work] = []
    for record in records:
        seen = viewer.view(record["salt"]) if record["parent"] is None else None
        if seen is not None:
            root_id = len(nodes)
            nodes.append(_node(root_id, None, "root", seen, 0, _Summary(), 0, 0, viewer))
            kids = tree.children[record["id"]]
            work.extend(_Work(root_id, 0, kid, trunk=i == 0) for i, kid in reversed(list(enumerate(kids))))
    # Depth first, so every node follows its parent, and a node's children follow in order, largest first.
    while work:
        item = work.pop()
        node_id, owner = len(nodes), (nodes[item.parent]["tenant"], nodes[item.parent]["salt"])
        if item.aggregate is not None:
            merged, span, count = item.aggregate
            nodes.append(
                _node(node_id, item.parent, "aggregate", owner, item.start, merged, span, count, viewer)
            )
            continue
        assert item.first is not None
        summary = _Summary()
        ids = tree.chain(item.first)
        for i in ids:
            summary.add(records[i], pinned)
        nodes.append(
            _node(
                node_id,
                item.parent,
                "pages",
                owner,
                item.start,
                summary,
                summary.tokens,
                0,
                viewer,
                item.trunk,
            )
        )
        end = item.start + summary.tokens
        kids = tree.children[ids[-1]]
        shown = kids if len(kids) <= MAX_CHILDREN + 1 else kids[:MAX_CHILDREN]
        rest = kids[len(shown) :]
        if rest:
            merged = _Summary()
            for kid in rest:
                for i in tree.subtree(kid):
                    merged.add(records[i], pinned)
            span = max(tree.subtree_span[kid] for kid in rest)
            work.append(_Work(node_id, end, aggregate=(merged, span, len(rest))))
        work.extend(_Work(node_id, end, kid) for kid in reversed(shown))
    return nodes


def _node(
    node_id: int,
    parent: int | None,
    kind: str,
    owner: tuple[str | None, str | None],  # the root's (tenant, salt)
    start: int,
    summary: _Summary,
    span: int,
    aggregated: int,
    viewer: Tenant,
    trunk: bool = False,
) -> dict[str, Any]:
    tenant, salt = owner
    sessions = sorted(_shown_sessions(summary.sessions, tenant, viewer))
    return {
        "id": node_id,
        "parent": parent,
        "kind": kind,
        "tenant": tenant,
        "salt": salt,
        "start": start,
        "tokens": summary.tokens,
        "span": span,
        "pages": summary.pages,
        "holders": summary.holders,
        "sessions": sessions[:MAX_SESSIONS_LISTED],
        "num_sessions": len(sessions),
        "tier": summary.tier if summary.tiers else None,
        "pinned": summary.pinned,
        "aggregated": aggregated,
        "trunk": trunk,
    }


def _shown_sessions(sessions: set[str], tenant: str | None, viewer: Tenant) -> Iterable[str]:
    """The root's tenant's sessions among a node's, as its clients named them; nobody else's."""
    for session in sessions:
        seen = viewer.view(session)
        if seen is not None and seen[0] == tenant and seen[1] is not None:
            yield seen[1]
