"""The host tier: pages of host memory that evicted device pages are copied into, their free list and copies.

The KV manager coordinates it beside the device pages: the radix index says which host page holds which
tokens; this tier hands out host pages, has its `PageMover` copy KV between the tiers, and counts it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class PageMover(Protocol):
    """Copies KV between the tiers; the KV manager calls it in the order it changes its books."""

    def offload(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy each (device page, host page) pair's KV to the host."""

    def load(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy each (host page, device page) pair's KV back to the device."""


@dataclass
class TierCounters:
    """Pages moved between the tiers since start."""

    stores: int = 0  # device pages copied to the host
    loads: int = 0  # host pages copied back to the device
    drops: int = 0  # host pages whose KV was dropped (the host tier was full)


class HostTier:
    """A fixed number of host pages; which ones hold KV is the radix index's business."""

    def __init__(self, num_pages: int, mover: PageMover | None = None) -> None:
        """`mover` copies the KV tensors (None: books only)."""
        if num_pages < 0:
            raise ValueError(f"a host tier cannot have {num_pages} pages")
        self.num_pages = num_pages
        self._mover = mover
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages
        self.counters = TierCounters()

    @property
    def num_free(self) -> int:
        """Host pages holding nothing."""
        return len(self._free)

    def allocate(self) -> int | None:
        """A free host page, or None when there is none."""
        if not self._free:
            return None
        page = self._free.pop()
        self._is_free[page] = False
        return page

    def copy_out(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy each (device page, host page) pair's KV to the host (before the device pages are reused)."""
        if moves and self._mover is not None:
            self._mover.offload(moves)
        self.counters.stores += len(moves)

    def copy_in(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy each (host page, device page) pair's KV back to the device; the host pages are free again."""
        if moves and self._mover is not None:
            self._mover.load(moves)
        self.free([host for host, _ in moves])
        self.counters.loads += len(moves)

    def drop(self, pages: Sequence[int]) -> None:
        """Host pages whose KV is given up for room: free again."""
        self.free(pages)
        self.counters.drops += len(pages)

    def free(self, pages: Sequence[int]) -> None:
        """Return host pages to the free list."""
        for page in pages:
            assert not self._is_free[page], f"host page {page} freed twice"
            self._is_free[page] = True
            self._free.append(page)

    def free_pages(self) -> set[int]:
        """The free host pages."""
        return set(self._free)
