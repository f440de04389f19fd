"""Retention: the sessions (the one owner of their state), and which unheld cached pages leave the device
first, judged by what those sessions still need.

A request may belong to a session (one agent's conversation). A session's newest turn supersedes its older
branches, a finished turn leaves the session paused (its agent waits on a tool and will come back), and a
release ends it. With the `session` policy, eviction takes unheld leaves in this order:

1. RELEASED: pages that only released sessions ever used: nobody will ask for them again.
2. SUPERSEDED: pages sessions used that no live or paused request of any session can reach again (an older
   branch the newest turn replaced, a retried turn's abandoned reply).
3. ACTIVE: unheld pages of sessions with a request running, and pages of requests without a session:
   least recently used first, as plain LRU would.
4. PAUSED: the tail of a session with no request running (its agent waits on a tool, or its next turn is
   queued), least recently active session first: its agent is about to return, and evicting its tail then
   costs the whole tail's prefill.
5. SHARED: pages two or more sessions reach (the shared head), last while any session references them.

Within a rank the least recently used page goes first, and only leaves go, so a path is evicted tail first.
The ranks are read at eviction time, so a session's priority changes after the fact: a new turn demotes the
old branch the moment it arrives. The `lru` policy gives every page the same rank: plain LRU.

The `return` policy keeps ranks 1 to 3 and orders what the paused sessions reach by when it is next used
(Belady's rule, on predictions): a paused session is expected back after its pending tool call's pause
(`returns.py`: the tool's observed pauses, a prior until there are any), one with a turn queued or preempted is
due now, and a page goes first the further away its next use is, weighed by what it costs to recompute: a page
`n` sessions reach (the shared head) scores its soonest session's wait divided by `n`. Sessions are
kept under either policy: each one's newest turn (the request the next turn continues), and at most
`max_open` of them, past which the one idle longest is released as if its client had released it. A session
id `GROUP\0ID` belongs to GROUP (the server's tenants): past `max_open`, the idle session released is the
longest idle of the group with the most open sessions, so a group that opens many sessions ends its own,
never those of a group with fewer.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from swarmkv.kv.radix_index import Node
from swarmkv.kv.returns import ReturnForecast

RetentionPolicy = Literal["lru", "session", "return"]
RETENTION_POLICIES: tuple[RetentionPolicy, ...] = ("lru", "session", "return")
GROUP_SEP = "\0"  # a session id "GROUP\0ID" counts in GROUP's share of `max_open`


def session_group(session_id: str) -> str:
    """The group a session id counts in: the part before GROUP_SEP ("" when there is none)."""
    group, sep, _ = session_id.partition(GROUP_SEP)
    return group if sep else ""


class Rank(enum.IntEnum):
    """Eviction rank: lower goes first."""

    RELEASED = 1
    SUPERSEDED = 2
    ACTIVE = 3
    PAUSED = 4
    SHARED = 5


@dataclass
class PageMarks:
    """What retention records on a page's tree node: the sessions that used it and those that reach it."""

    owners: set[str] = field(default_factory=set)  # sessions whose requests computed or reused this page
    anonymous: bool = False  # a request without a session computed or reused it
    reach: dict[str, int] = field(default_factory=dict)  # session -> its requests whose path runs here


_NO_MARKS = PageMarks()


def _marks(node: Node) -> PageMarks:
    """The node's marks, made on first write."""
    if node.marks is None:
        node.marks = PageMarks()
    marks: PageMarks = node.marks
    return marks


@dataclass
class _Session:
    newest: str  # the request id of its newest turn
    newest_turn: Any = None  # that request, as the caller gave it: what the next turn continues
    live: set[str] = field(default_factory=set)  # its requests waiting or running
    running: set[str] = field(default_factory=set)  # those holding pages
    last_active: int = 0
    paused_at_s: float | None = None  # by the clock, when its last live request closed (its tool runs)
    tool: str | None = None  # the tool its newest turn's reply called, when the caller said
    returns_at_s: float | None = None  # by the clock, when the caller said its next turn comes (inf: never)


class Retention:
    """Session states and the eviction order they imply; told about requests by the KV manager's caller."""

    def __init__(
        self,
        policy: RetentionPolicy = "session",
        max_open: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        forecast: ReturnForecast | None = None,
    ) -> None:
        if policy not in RETENTION_POLICIES:
            raise ValueError(f"retention must be one of {RETENTION_POLICIES}, got {policy!r}")
        self.policy = policy
        self.max_open = max_open
        self.clock = clock  # seconds, for tool pauses
        self.forecast = forecast or ReturnForecast()
        self._sessions: dict[str, _Session] = {}
        self._session_of: dict[str, str] = {}  # request id -> session, while the request reaches pages
        self._paths: dict[str, list[Node]] = {}  # request id -> the nodes it marked as reached
        self._clock = itertools.count(1)

    # Reading.

    def session_of(self, request_id: str) -> str | None:
        """The session a live or newest request belongs to."""
        return self._session_of.get(request_id)

    def owners(self, node: Node) -> list[str]:
        """The sessions whose requests computed or reused the node's page, sorted."""
        marks: PageMarks = node.marks or _NO_MARKS
        return sorted(marks.owners)

    def reach(self, node: Node) -> dict[str, int]:
        """Session -> its live or newest requests whose path runs through the node (a copy)."""
        marks: PageMarks = node.marks or _NO_MARKS
        return dict(marks.reach)

    def newest_turn(self, session_id: str) -> Any:
        """The open session's newest turn, as given to `open` (None if the session is not open)."""
        session = self._sessions.get(session_id)
        return session.newest_turn if session is not None else None

    @property
    def num_open(self) -> int:
        """Sessions not released."""
        return len(self._sessions)

    @property
    def num_paused(self) -> int:
        """Open sessions with no request running."""
        return sum(1 for s in self._sessions.values() if not s.running)

    def key(self, node: Node) -> tuple[Any, ...]:
        """The eviction order of an unheld leaf before its last use: (rank, tie-break)."""
        if self.policy == "lru":
            return ()
        marks: PageMarks = node.marks or _NO_MARKS
        reach = marks.reach
        if not reach:
            if marks.anonymous or not marks.owners:
                return (Rank.ACTIVE, 0)
            if any(owner in self._sessions for owner in marks.owners):
                return (Rank.SUPERSEDED, 0)
            return (Rank.RELEASED, 0)
        if len(reach) > 1:
            return self._return_key(reach) if self.policy == "return" else (Rank.SHARED, 0)
        session = self._sessions[next(iter(reach))]
        if session.running:
            return (Rank.ACTIVE, 0)
        if self.policy == "return":
            return self._return_key(reach)
        return (Rank.PAUSED, session.last_active)

    def _return_key(self, reach: dict[str, int]) -> tuple[Any, ...]:
        """Furthest next use first, weighed by cost: the soonest reaching session's wait over their number."""
        soonest_s = min(self.return_in_s(session_id) for session_id in reach)
        return (Rank.PAUSED, -soonest_s / len(reach))

    def return_in_s(self, session_id: str) -> float:
        """Expected seconds until the session next uses its pages: 0 with a request live (queued, preempted
        or running), else its pending tool call's expected remaining pause."""
        session = self._sessions.get(session_id)
        if session is None or session.live:
            return 0.0
        if session.returns_at_s is not None:
            return max(0.0, session.returns_at_s - self.clock())
        if session.paused_at_s is None:
            return 0.0
        return self.forecast.remaining_s(session.tool, self.clock() - session.paused_at_s)

    # Changing.

    def open(self, request_id: str, session_id: str, turn: Any = None) -> None:
        """A new turn of `session_id` arrives (`turn`: the request itself, for `newest_turn`): it becomes the
        newest, superseding a finished older turn. Past `max_open` sessions, the one idle longest goes."""
        if (
            request_id in self._session_of
        ):  # a finished turn's id, reused: keep the old turn under another key
            self._rekey(request_id)
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = _Session(request_id)
        else:
            previous = session.newest
            session.newest = request_id
            if previous not in session.live:
                self._forget(previous)
            if session.paused_at_s is not None:  # back from its tool: one observation of its pause
                self.forecast.observe(session.tool, self.clock() - session.paused_at_s)
                session.paused_at_s, session.tool = None, None
            session.returns_at_s = None
        session.newest_turn = turn
        session.live.add(request_id)
        session.last_active = next(self._clock)
        self._session_of[request_id] = session_id
        if self.max_open is not None and len(self._sessions) > self.max_open:
            self._release_longest_idle()

    def _release_longest_idle(self) -> None:
        """Clients that never release: end the longest idle session of the largest group that has one."""
        sizes: dict[str, int] = {}
        for session_id in self._sessions:
            group = session_group(session_id)
            sizes[group] = sizes.get(group, 0) + 1
        idle = [
            (-sizes[session_group(sid)], s.last_active, sid)
            for sid, s in self._sessions.items()
            if not s.live
        ]
        if idle:
            self.release(min(idle)[2])

    def run(self, request_id: str, running: bool) -> None:
        """The request was admitted (holds pages) or stopped running (preempted or finished)."""
        session_id = self._session_of.get(request_id)
        if session_id is None:
            return
        session = self._sessions[session_id]
        if running:
            session.running.add(request_id)
        else:
            session.running.discard(request_id)
            session.last_active = next(self._clock)

    def close(self, request_id: str) -> None:
        """A request finished for good: unless it is its session's newest turn, it reaches nothing now."""
        session_id = self._session_of.get(request_id)
        if session_id is None:
            return
        session = self._sessions[session_id]
        session.live.discard(request_id)
        session.running.discard(request_id)
        session.last_active = next(self._clock)
        if not session.live:
            session.paused_at_s = self.clock()
        if session.newest != request_id:
            self._forget(request_id)

    def pending_tool(self, session_id: str) -> str | None:
        """The tool the open session's newest reply called, as the caller said (None: not said, or not open)."""
        session = self._sessions.get(session_id)
        return session.tool if session is not None else None

    def note_tool(self, session_id: str, tool: str | None) -> bool:
        """The session's newest reply called `tool`: its return is forecast from that tool's pauses. False if
        the session is not open."""
        session = self._sessions.get(session_id)
        if session is None:
            return False
        session.tool = tool
        return True

    def expect_return(self, session_id: str, in_s: float) -> bool:
        """The caller knows the paused session's next turn comes in `in_s` seconds (math.inf: it will not
        continue these pages, as after a compaction): under `return`, that replaces the forecast until the
        turn arrives. A benchmark's oracle uses it to order evictions by true next use (Belady's rule). False
        if the session is not open."""
        session = self._sessions.get(session_id)
        if session is None:
            return False
        session.returns_at_s = self.clock() + in_s
        return True

    def release(self, session_id: str) -> bool:
        """End a session: its pages reach nothing and are first to go. False if it is not open."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        for request_id in [session.newest, *session.live]:
            self._forget(request_id)
        return True

    def mark_path(self, request_id: str, nodes: Iterable[Node]) -> None:
        """The request's KV now sits at `nodes` (it stopped running): they stay reachable while it is live
        or its session's newest turn."""
        session_id = self._session_of.get(request_id)
        if session_id is None:
            return
        self._unmark(request_id)
        path = list(nodes)
        for node in path:
            reach = _marks(node).reach
            reach[session_id] = reach.get(session_id, 0) + 1
        self._paths[request_id] = path

    def tag(self, nodes: Iterable[Node], session_id: str | None) -> None:
        """These pages were computed or reused by a request of `session_id` (None: of no session)."""
        for node in nodes:
            if session_id is None:
                _marks(node).anonymous = True
            else:
                _marks(node).owners.add(session_id)

    def _rekey(self, request_id: str) -> None:
        old_key = f"{request_id}#{next(self._clock)}"
        session_id = self._session_of.pop(request_id)
        self._session_of[old_key] = session_id
        if request_id in self._paths:
            self._paths[old_key] = self._paths.pop(request_id)
        session = self._sessions[session_id]
        if session.newest == request_id:
            session.newest = old_key
        session.live.discard(request_id)
        session.running.discard(request_id)

    def _forget(self, request_id: str) -> None:
        self._unmark(request_id)
        self._session_of.pop(request_id, None)

    def _unmark(self, request_id: str) -> None:
        session_id = self._session_of.get(request_id)
        for node in self._paths.pop(request_id, ()):
            assert session_id is not None
            reach = _marks(node).reach
            count = reach.get(session_id, 0) - 1
            if count > 0:
                reach[session_id] = count
            else:
                reach.pop(session_id, None)
