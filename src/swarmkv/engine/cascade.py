"""Which decodes read a shared prefix once (cascade attention), and when that is worth an extra pass.

Decodes are grouped per radix node: requests whose tables hold the same first pages hold the same cached
prefix (pages are shared only through the index), so the page tables spell the radix tree, and a group
reads the pages its members hold in common once. A group pays one extra attention pass and a log-sum-exp merge; it saves
reading its prefix once per member beyond the first. `auto` groups only where the saving is worth it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from swarmkv.choices import CascadeMode
from swarmkv.resolve import TORCH_MIN_SAVED_TOKENS

# `auto` groups when the prefix reads it saves, (members - 1) x shared tokens, reach this. Measured on the
# CPU with bench/cascade.py (SmolLM2-135M's heads, one layer): the extra pass and merge cost about 0.5 ms,
# 2 x 2,048 shared tokens still lose (0.68x), 4 x 1,024 win (4.1x), 8 x 512 break even (0.94x to 1.5x).
# This is the torch backend's point; the triton backend has its own (both in swarmkv/resolve.py).
AUTO_MIN_SAVED_TOKENS = TORCH_MIN_SAVED_TOKENS


@dataclass(frozen=True)
class CascadeGroup:
    """Decodes (indices into the step's decode list) that share their first `num_pages` pages."""

    members: list[int]
    num_pages: int


def plan_groups(
    host_table: torch.Tensor,
    rows: list[int],
    shareable_pages: list[int],
    page_size: int,
    mode: CascadeMode,
    min_saved_tokens: int = AUTO_MIN_SAVED_TOKENS,
) -> list[CascadeGroup]:
    """Cascade groups among decodes in page-table `rows`, each sharing at most `shareable_pages` pages
        (those wholly before the token it decodes: the page being written is never shared). Groups follow
        the tree the page tables spell: at each branch point the decodes below are grouped there, or left to
        the deeper groups of its branches, whichever saves more prefix reads. `auto` groups where the reads
    saved reach `min_saved_tokens` (the attention backend's own break-even)."""
    if mode == "off" or len(rows) < 2 or max(shareable_pages) == 0:
        return []
    width = max(shareable_pages)
    table = host_table[rows, :width]  # one gather; entries past a row's own limit are never compared
    # No two rows share a first page (most batches of distinct prompts): no tree to walk. The walk's small
    # tensor operations were ~2% of a batch-8 step.
    first_pages = table[:, 0].tolist()
    if len(set(first_pages)) == len(first_pages):
        return []
    limits = torch.tensor(shareable_pages)
    min_saved = 1 if mode == "on" else min_saved_tokens

    def value(members: list[int], depth: int) -> int:
        saved = (len(members) - 1) * depth * page_size
        return saved if depth and saved >= min_saved else 0

    def best(members: list[int], depth: int) -> tuple[int, list[CascadeGroup]]:
        index = torch.tensor(members)
        member_limits = limits[index]
        limit = int(member_limits.min())
        if limit > depth:  # walk down while every member holds the same page
            block = table[index, depth:limit]
            depth += int((block == block[:1]).all(0).int().cumprod(0).sum())
        branches: dict[int, list[int]] = defaultdict(list)
        if depth < width:
            pages = table[index, depth].tolist()
            for i, page, own_limit in zip(members, pages, member_limits.tolist(), strict=True):
                if own_limit > depth:
                    branches[page].append(i)
        deeper_saved, deeper = 0, list[CascadeGroup]()
        for branch in branches.values():
            if len(branch) >= 2:
                saved, groups = best(branch, depth + 1)
                deeper_saved, deeper = deeper_saved + saved, deeper + groups
        here = value(members, depth)
        if here and here >= deeper_saved:
            return here, [CascadeGroup(members, depth)]
        return deeper_saved, deeper

    return best(list(range(len(rows))), 0)[1]
