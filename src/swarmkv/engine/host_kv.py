"""The host tier's KV tensors: a second pool of pages in host memory, and the copies between the tiers.

A host page holds one device page's K and V for every layer, contiguous (page-major), so a move is one copy
per slab. On CUDA (and ROCm) the host pages are pinned and every copy runs on a side stream that first
waits for the compute stream and that the compute stream then waits for: the host never blocks, and a
forward never reads a page before its load lands. On the CPU the copies are plain and synchronous, so the
whole path runs in tests.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from swarmkv.engine.kv_cache import KVCache


class HostKV:
    """`num_pages` host pages shaped like the device pages of `kv`; implements the KV manager's PageMover."""

    def __init__(self, kv: KVCache, num_pages: int) -> None:
        self.kv = kv
        self.device = kv.k.device
        num_layers, _, heads, dim = kv.k.shape
        shape = (num_pages, num_layers, kv.block_size, heads, dim)
        gpu = self.device.type == "cuda"
        self.k = torch.zeros(shape, dtype=kv.storage_dtype, pin_memory=gpu)
        self.v = torch.zeros(shape, dtype=kv.storage_dtype, pin_memory=gpu)
        self._stream = torch.cuda.Stream(self.device) if gpu else None

    @property
    def page_bytes(self) -> int:
        """Bytes one host page holds (K and V, every layer)."""
        return 2 * self.k[0].numel() * self.k.element_size()

    def offload(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy each (device page, host page)'s KV to the host."""
        size = self.kv.block_size
        with self._side_stream():
            for page, host in moves:
                device_slots = slice(page * size, (page + 1) * size)
                self.k[host].copy_(self.kv.k[:, device_slots], non_blocking=True)
                self.v[host].copy_(self.kv.v[:, device_slots], non_blocking=True)

    def load(self, moves: Sequence[tuple[int, int]]) -> None:
        """Copy each (host page, device page)'s KV back to the device."""
        size = self.kv.block_size
        with self._side_stream():
            for host, page in moves:
                device_slots = slice(page * size, (page + 1) * size)
                self.kv.k[:, device_slots].copy_(self.k[host], non_blocking=True)
                self.kv.v[:, device_slots].copy_(self.v[host], non_blocking=True)

    @contextlib.contextmanager
    def _side_stream(self) -> Iterator[None]:
        if self._stream is None:
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # the pages' earlier writes and reads are done
        with torch.cuda.stream(self._stream):
            yield
        compute.wait_stream(self._stream)  # the next forward sees the loaded pages
