"""How many threads the C decode step uses, chosen by timing it. A step has some 300 barriers; when other work
holds the cores (a harness, a build, a second server), a thread that loses its core stalls every barrier, and
two threads can run many times slower than one. So the step runs on the full team by default and every so often
tries the other choice on a real step; the faster per row wins until the next try. Tries that lose come less
often (up to every `MAX_INTERVAL` steps). Results do not depend on the count: every output element is computed by
one thread in the same order."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
FIRST_INTERVAL, MAX_INTERVAL = 16, 1024  # steps between tries of the other choice
SMOOTHING = 0.2  # weight of a new step in the running cost per row


class ThreadChoice:
    """The thread count of the next step: `team` (torch's count) or 1, by measured seconds per row."""

    def __init__(self, team: int) -> None:
        self.choices = sorted({team, 1}, reverse=True)
        self.current = self.choices[0]
        self.cost: dict[int, float] = {}  # seconds per row, smoothed, per choice
        self.interval = FIRST_INTERVAL
        self.until_try = FIRST_INTERVAL

    def run(self, rows: int, step: Callable[[int], T]) -> T:
        """Run `step(threads)` for a batch of `rows`, timing it to inform the next choices."""
        trying = len(self.choices) > 1 and self.until_try <= 0
        threads = self._other() if trying else self.current
        start = time.perf_counter()
        result = step(threads)
        per_row = (time.perf_counter() - start) / max(rows, 1)
        old = self.cost.get(threads)
        self.cost[threads] = per_row if old is None or trying else old + SMOOTHING * (per_row - old)
        if trying:
            if per_row < 0.9 * self.cost.get(self.current, float("inf")):
                self.current, self.interval = threads, FIRST_INTERVAL
            else:
                self.interval = min(2 * self.interval, MAX_INTERVAL)
            self.until_try = self.interval
        else:
            self.until_try -= 1
        return result

    def _other(self) -> int:
        return next(c for c in self.choices if c != self.current)
