"""How the plan report lays figures out: right-aligned tables, sizes in GiB or MiB, labelled breakdowns."""

from __future__ import annotations

from collections.abc import Sequence

from swarmkv.units import format_gib

Item = tuple[str, int, str]  # label, bytes, how the figure was made


def table(headers: Sequence[str], cells: Sequence[Sequence[str]]) -> list[str]:
    """Headers and cells, each column right-aligned to its widest entry."""
    widths = [max(len(h), *(len(line[i]) for line in cells)) for i, h in enumerate(headers)]
    return ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in [headers, *cells]]


def size(num_bytes: int) -> str:
    """GiB from 1 GiB up, MiB below."""
    return format_gib(num_bytes) if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def breakdown(items: list[Item]) -> list[str]:
    """Labels left-aligned, sizes right-aligned, then each figure's arithmetic."""
    label_width = max(len(label) for label, _, _ in items)
    sizes = [size(num_bytes) for _, num_bytes, _ in items]
    size_width = max(map(len, sizes))
    return [
        f"  {label.ljust(label_width)}  {text.rjust(size_width)}  {note}".rstrip()
        for (label, _, note), text in zip(items, sizes, strict=True)
    ]
