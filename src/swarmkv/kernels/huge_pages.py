"""CPU tensors moved into memory that Linux backs with transparent huge pages.

A CPU decode step reads every weight once, from a few hundred tensors, most of them under 2 MiB. On 4 KiB pages
that is some 25,000 TLB misses a step for the embedded model's 100 MB; on 2 MiB pages, about fifty. Linux gives an
anonymous mapping huge pages when `transparent_hugepage/enabled` is `always`, or `madvise` and the mapping asks
(MADV_HUGEPAGE), but only in aligned 2 MiB spans, which a small tensor's own allocation never holds. So
`pack_tensors` copies the tensors into one such mapping and re-points each at its copy: every holder of a tensor
object sees the move, views keep their offsets, and the old memory goes. The KV slabs (`huge_zeros`) get their own
mapping. Where the OS gives no huge pages (another OS, THP `never`) nothing moves. Measured on the embedded model
(the C decode step, 2 threads, bench/decode.py): see docs/benchmarks.md (Decode on the CPU).

`SWARMKV_HUGE_PAGES=off` in the environment asks for none. Where memory is fragmented and THP's `defrag` setting
compacts memory at each huge-page fault (`madvise`, the default, does for these mappings), touching a fresh
mapping stalls in the kernel: on this project's 2-core test machine a 1 GiB KV pool's first touch took from 0.1 s
to 15 s of system time, most of it in compaction (`compact_stall` in /proc/vmstat). The test suite, which builds
hundreds of engines, turns them off (tests/conftest.py).
"""

from __future__ import annotations

import math
import mmap
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGN = 64  # each storage starts on a cache line
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
HUGE_PAGES_ENV = "SWARMKV_HUGE_PAGES"  # "off" (or 0, no, false): ask for no huge pages


def huge_pages_available() -> bool:
    """Whether huge pages are wanted (`SWARMKV_HUGE_PAGES` is not off) and the OS can give them."""
    if os.environ.get(HUGE_PAGES_ENV, "").strip().lower() in ("off", "0", "no", "false"):
        return False
    return huge_pages_supported()


def huge_pages_supported() -> bool:
    """Whether an anonymous mapping that asks for huge pages can get them here."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def huge_mapping(num_bytes: int) -> torch.Tensor:
    """`num_bytes` zeroed bytes (uint8) starting on a huge page boundary of a mapping that asks for huge pages.
    Its pages are allocated when first touched; the tensor keeps the mapping alive."""
    mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zeroed
    mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start : start + num_bytes]


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on a CPU with huge pages, in its own huge-page mapping. Every page is written here, as
    torch.zeros does, so a pool larger than the machine's memory fails at start, not once it fills."""
    if device.type != "cpu" or not huge_pages_available():
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * dtype.itemsize
    return huge_mapping(num_bytes).zero_().view(dtype).view(shape)


def pack_tensors(tensors: Iterable[torch.Tensor]) -> int:
    """Move the storages of the CPU `tensors` into one huge-page mapping and re-point every tensor given at its
    copy (a storage's views keep their offsets and stay aliased). Returns the bytes moved: 0 where huge pages are
    not available. Run it before anything keeps a raw pointer into them."""
    if not huge_pages_available():
        return 0
    storages: dict[int, tuple[torch.UntypedStorage, list[torch.Tensor]]] = {}
    for t in tensors:
        if t.device.type != "cpu" or t.layout != torch.strided or t.untyped_storage().nbytes() == 0:
            continue
        storage = t.untyped_storage()
        storages.setdefault(storage.data_ptr(), (storage, []))[1].append(t)
    total = sum(_padded(storage.nbytes()) for storage, _ in storages.values())
    if not total:
        return 0
    arena = huge_mapping(total)
    base = arena.storage_offset()
    offset = 0
    with torch.inference_mode():
        for storage, views in storages.values():
            size = storage.nbytes()
            arena[offset : offset + size].copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            for t in views:
                start = base + offset
                assert start % t.element_size() == 0
                t.set_(
                    arena.untyped_storage(),
                    start // t.element_size() + t.storage_offset(),
                    t.size(),
                    t.stride(),
                )
            offset += _padded(size)
    return total


def _padded(num_bytes: int) -> int:
    return -(-num_bytes // ALIGN) * ALIGN
