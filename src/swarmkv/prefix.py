"""The length of the common prefix of two sequences: the one comparison the scheduler, the server's cache-break
history and `swarmkv lint` all make."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def common_prefix_length(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How many leading items `a` and `b` share (lists, tuples, arrays or strings of the same kind): a binary
    search over slice comparisons, which run in C, so long prompts cost a few dozen of them."""
    low, high = 0, min(len(a), len(b))
    while low < high:  # invariant: a[:low] == b[:low]
        mid = (low + high + 1) // 2
        if a[low:mid] == b[low:mid]:
            low = mid
        else:
            high = mid - 1
    return low
