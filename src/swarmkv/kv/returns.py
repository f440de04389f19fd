"""When a paused agent comes back: each tool's observed pauses, and a paused session's expected time to return.

A session pauses when its turn ends (its agent runs the tool its reply called) and returns with its next turn;
the gap is one observation of that tool's pause. A session paused `elapsed_s` ago on tool T is expected back in
the mean of T's observed pauses longer than `elapsed_s`, less `elapsed_s`. A call that has outlasted every pause
seen for its tool is expected to run about as long again as it already has (a build that has not returned within
a minute is likely to take minutes). Until a tool has observations, the pauses of every tool stand in for it, and
until there are any, one prior pause does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

PRIOR_PAUSE_S = 2.0  # an agent's tool call, before any has been observed
PAUSES_KEPT = 64  # per tool: recent pauses say more than old ones when a workload shifts


class ReturnForecast:
    """Observed pauses per tool name (None: a turn whose tool call is unknown) and the expected return."""

    def __init__(self, prior_pause_s: float = PRIOR_PAUSE_S, pauses_kept: int = PAUSES_KEPT) -> None:
        self.prior_pause_s = prior_pause_s
        self._pauses: dict[str | None, deque[float]] = {}
        self._all: deque[float] = deque(maxlen=pauses_kept * 4)
        self._kept = pauses_kept

    def observe(self, tool: str | None, pause_s: float) -> None:
        """A session paused on `tool` came back after `pause_s` seconds."""
        self._pauses.setdefault(tool, deque(maxlen=self._kept)).append(pause_s)
        self._all.append(pause_s)

    def pauses(self, tool: str | None) -> Iterable[float]:
        """The pauses that predict `tool`'s: its own, else every tool's, else the prior (not copied: eviction
        asks for every session reaching every leaf)."""
        return self._pauses.get(tool) or self._all or (self.prior_pause_s,)

    def remaining_s(self, tool: str | None, elapsed_s: float) -> float:
        """Expected seconds until a session paused `elapsed_s` ago on `tool` returns."""
        longer = [p for p in self.pauses(tool) if p > elapsed_s]
        if not longer:
            return elapsed_s  # it outlasted every pause seen: expect it to run as long again
        return sum(longer) / len(longer) - elapsed_s
