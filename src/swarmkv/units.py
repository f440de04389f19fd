"""Byte sizes as people write them ("1GiB", "512MB", 1073741824) and back."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

GIB = 1024**3


def parse_size(value: str | int) -> int:
    """Bytes in a size such as "1GiB", "1.5GB" or 4096; ValueError on anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    match = _SIZE.match(str(value))
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read size {value!r}; write e.g. 1GiB, 512MiB, 16GB or a number of bytes")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def format_gib(num_bytes: float) -> str:
    """Bytes as GiB with two decimals."""
    return f"{num_bytes / GIB:.2f} GiB"
