"""The runner's resident page tables: one row per running request, updated from each step's plan.

Page tables are append-only (the KV manager never rewrites an entry), so a step only writes the pages a
request gained; a row is dropped when its request is freed and handed to the next admission. The host
tensor is the source of the incremental copy to the device, where GPU attention kernels can read it.
"""

from __future__ import annotations

import torch

from swarmkv.kv import pages_for


class PageTable:
    """A [max_rows, max_pages] table of page ids, with a copy on the model's device."""

    def __init__(self, max_rows: int, max_pages: int, page_size: int, device: torch.device) -> None:
        self.page_size = page_size
        self.device = device
        self.host = torch.zeros((max_rows, max_pages), dtype=torch.int64)
        self.table = self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        self._rows: dict[str, int] = {}
        self._lengths = [0] * max_rows
        self._spare = list(range(max_rows - 1, -1, -1))
        self._dirty: set[int] = set()

    def drop(self, request_ids: list[str]) -> None:
        """Forget freed requests' rows (unknown ids are ignored: a request may be freed before it ran)."""
        for rid in request_ids:
            row = self._rows.pop(rid, None)
            if row is not None:
                self._lengths[row] = 0
                self._spare.append(row)

    def append(self, request_id: str, pages: list[int]) -> None:
        """Add pages to the end of a request's row, giving it a row if it has none."""
        row = self._rows.get(request_id)
        if row is None:
            assert self._spare, "more running requests than page-table rows"
            row = self._rows[request_id] = self._spare.pop()
        start = self._lengths[row]
        assert start + len(pages) <= self.host.shape[1], f"{request_id} outgrew its page-table row"
        self.host[row, start : start + len(pages)] = torch.tensor(pages, dtype=torch.int64)
        self._lengths[row] = start + len(pages)
        self._dirty.add(row)

    def sync(self) -> None:
        """Copy the rows changed since the last sync to the device (nothing to do on the CPU)."""
        if self.table is not self.host and self._dirty:
            rows = torch.tensor(sorted(self._dirty), dtype=torch.int64)
            changed = self.host[rows]
            if self.device.type == "cuda":
                rows, changed = rows.pin_memory(), changed.pin_memory()  # so the copies do not wait
            self.table[rows.to(self.device, non_blocking=True)] = changed.to(self.device, non_blocking=True)
        self._dirty.clear()

    @property
    def request_ids(self) -> set[str]:
        """Requests that have a row."""
        return set(self._rows)

    def row(self, request_id: str) -> int:
        """The row holding a request's pages."""
        return self._rows[request_id]

    def pages(self, request_id: str) -> list[int]:
        """A request's pages as a list (for checks; the hot path reads the tensors)."""
        row = self._rows[request_id]
        return self.host[row, : self._lengths[row]].tolist()

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Cache slots of token `positions` of the requests in `rows` (same shape, on the device)."""
        size = self.page_size
        return self.table[rows, positions // size] * size + positions % size

    def context_slots(self, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Slots of positions [0, num_tokens) of each request in `rows`: [len(rows), num_tokens]."""
        size = self.page_size
        pages = self.table[rows, : pages_for(num_tokens, size)]
        offsets = torch.arange(size, device=self.device)
        return (pages[:, :, None] * size + offsets).reshape(len(rows), -1)[:, :num_tokens]
