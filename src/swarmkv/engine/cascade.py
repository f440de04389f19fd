"""Which decodes read a shared prefix once (cascade attention), and when that is worth an extra pass.

Decodes are grouped per radix node: requests whose tables start with the same page hold the same cached
prefix (pages are shared only through the index), and the group's shared part is the pages all of its
members hold in the same places. A group pays one extra attention pass and a log-sum-exp merge; it saves
reading its prefix once per member beyond the first. `auto` groups only where the saving is worth it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Literal

import torch

CascadeMode = Literal["auto", "on", "off"]
CASCADE_MODES: tuple[CascadeMode, ...] = ("auto", "on", "off")

# `auto` groups when the prefix reads it saves, (members - 1) x shared tokens, reach this. Measured on the
# CPU with bench/cascade.py (SmolLM2-135M's heads): the extra pass and merge cost about 0.5 ms a layer,
# which a group repays from about 2,000 saved token reads on (8 x 256 shared: 0.8x, 8 x 512: 1.5x).
AUTO_MIN_SAVED_TOKENS = 2048


@dataclass(frozen=True)
class CascadeGroup:
    """Decodes (indices into the step's decode list) that share their first `num_pages` pages."""

    members: list[int]
    num_pages: int


def plan_groups(
    host_table: torch.Tensor, rows: list[int], shareable_pages: list[int], page_size: int, mode: CascadeMode
) -> list[CascadeGroup]:
    """Cascade groups among decodes in page-table `rows`, each sharing at most `shareable_pages` pages
    (those wholly before the token it decodes: the page being written is never shared)."""
    if mode == "off" or len(rows) < 2:
        return []
    by_head: dict[int, list[int]] = defaultdict(list)
    heads = host_table[rows, 0].tolist()
    for i, (head, limit) in enumerate(zip(heads, shareable_pages, strict=True)):
        if limit > 0:
            by_head[head].append(i)
    groups = []
    for members in by_head.values():
        if len(members) < 2:
            continue
        limit = min(shareable_pages[i] for i in members)
        pages = host_table[[rows[i] for i in members], :limit]
        same = (pages == pages[0]).all(dim=0)
        num_pages = int(same.cumprod(dim=0).sum())
        saved_tokens = (len(members) - 1) * num_pages * page_size
        if num_pages and (mode == "on" or saved_tokens >= AUTO_MIN_SAVED_TOKENS):
            groups.append(CascadeGroup(members, num_pages))
    return groups
