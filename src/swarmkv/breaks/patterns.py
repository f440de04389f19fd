"""Volatile values a harness writes into prompts: dates and times, UUIDs, hex strings and nonces."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

VolatileKind = Literal["timestamp", "random_id"]

_MONTH = (
    r"\b(?:January|February|March|April|May|June|July|August|September|October|November|December"
    r"|Jan|Feb|Mar|Apr|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)\b\.?"
)
_WEEKDAY = (
    r"\b(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday|Mon|Tue|Wed|Thu|Fri|Sat|Sun)\b\.?,?"
)
_CLOCK = r"\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d+)?)?(?:\s?[AaPp]\.?[Mm]\.?)?(?:\s?(?:Z|UTC|GMT|[+-]\d{2}:?\d{2}))?"


def _any(alternatives: tuple[str, ...]) -> str:
    return r"\b(?:" + "|".join(alternatives) + ")"


# Longer forms first: the first alternative that matches at a position wins. The leading \b lets the
# scan skip positions inside words at once.
TIMESTAMP = re.compile(
    _any(
        (
            rf"\d{{4}}-\d{{2}}-\d{{2}}(?:[T ]{_CLOCK})?",  # ISO 8601
            rf"(?:{_WEEKDAY}\s+)?{_MONTH}\s+\d{{1,2}}(?:st|nd|rd|th)?,?(?:\s+{_CLOCK})?(?:,?\s+\d{{4}})?(?:\s+{_CLOCK})?",
            rf"(?:{_WEEKDAY}\s+)?\d{{1,2}}\s+{_MONTH},?\s+\d{{4}}(?:\s+{_CLOCK})?",  # 26 Jul 2024
            r"\b\d{4}/\d{1,2}/\d{1,2}\b|\b\d{1,2}[/.]\d{1,2}[/.]\d{2,4}\b",
            rf"\b{_CLOCK}",
            r"\b1\d{9}(?:\.\d+)?\b|\b1\d{12}\b",  # unix seconds (2001-2033) or milliseconds
        )
    )
)

RANDOM_ID = re.compile(
    _any(
        (
            r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b",  # UUID
            r"(?i:\b(?:nonce|request[_ -]?id|req[_ -]?id|trace[_ -]?id|run[_ -]?id)\s*[:=]\s*)[\w+/=-]+",
            r"\b(?=[0-9a-fA-F]*\d)(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{8,}\b",  # hex with digits and letters
            r"\b(?=(?:[A-Za-z]*\d){2})(?=(?:\d*[A-Za-z]){2})[A-Za-z0-9]{16,}\b",  # letters and digits mixed
        )
    )
)

# How far around a position a volatile value may start or end; longer values are not dates or ids.
_WINDOW = 96


@dataclass(frozen=True)
class Volatile:
    """A volatile value found in a text: its kind and its span [start, end) in characters."""

    kind: VolatileKind
    start: int
    end: int


def volatile_at(text: str, pos: int) -> Volatile | None:
    """The date, time or random id in `text` that covers character `pos`, if any."""
    lo = max(0, pos - _WINDOW)
    window = text[lo : pos + _WINDOW]
    kinds: tuple[tuple[VolatileKind, re.Pattern[str]], ...] = (
        ("timestamp", TIMESTAMP),
        ("random_id", RANDOM_ID),
    )
    for kind, pattern in kinds:
        for match in pattern.finditer(window):
            start, end = lo + match.start(), lo + match.end()
            if start <= pos < end:
                return Volatile(kind, start, end)
    return None


class VolatileScanner:
    """`volatile_spans` line by line, each distinct line scanned once: a log repeats most of its lines."""

    def __init__(self) -> None:
        self._lines: dict[str, list[Volatile]] = {}

    def spans(self, text: str) -> list[Volatile]:
        """Every date, time and random id in `text` (none spans a line break), in order."""
        found, at = [], 0
        for line in text.split("\n"):
            spans = self._lines.get(line)
            if spans is None:
                spans = self._lines[line] = volatile_spans(line)
            found += [Volatile(v.kind, v.start + at, v.end + at) for v in spans]
            at += len(line) + 1
        return found


def volatile_spans(text: str) -> list[Volatile]:
    """Every date, time and random id in `text`, in order, none overlapping."""
    found: list[Volatile] = [Volatile("timestamp", m.start(), m.end()) for m in TIMESTAMP.finditer(text)]
    for match in RANDOM_ID.finditer(text):
        if not any(v.start < match.end() and match.start() < v.end for v in found):
            found.append(Volatile("random_id", match.start(), match.end()))
    return sorted(found, key=lambda v: v.start)
