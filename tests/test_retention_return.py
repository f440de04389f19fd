"""The `return` retention: paused sessions' pages go in order of their expected return (no model)."""

from __future__ import annotations

import math

import pytest

from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.sequence import Sequence
from swarmkv.kv import KVCacheManager, Rank, Retention
from swarmkv.kv.returns import ReturnForecast

PAGE = 2
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
HEAD = [1, 2, 3, 4]  # two pages every session starts with


class Clock:
    """A clock the test moves by hand, in seconds."""

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


class Agents:
    """A KV manager under the `return` retention, and the moves the engine makes for session turns."""

    def __init__(self, policy: str = "return") -> None:
        self.clock = Clock()
        retention = Retention(policy, clock=self.clock)  # type: ignore[arg-type]
        self.kv = KVCacheManager(64, PAGE, retention=retention)
        self.n = 0

    def start(self, tokens: list[int], session: str) -> Sequence:
        """Open a turn (queued, not admitted)."""
        self.n += 1
        seq = Sequence(f"r{self.n}", tokens, PARAMS, session_id=session)
        self.kv.open_turn(seq)
        return seq

    def run(self, seq: Sequence, tool: str | None = None) -> Sequence:
        """Admit, compute every token, finish; its reply called `tool`."""
        hit = self.kv.lookup(seq.token_ids[:-1], None)
        assert self.kv.allocate(seq, hit, seq.num_tokens - hit.num_tokens) is not None
        seq.num_computed_tokens = seq.num_tokens
        self.kv.commit(seq, seq.num_tokens)
        self.kv.free(seq)
        self.kv.close(seq.request_id)
        assert seq.session_id is not None
        self.kv.note_tool(seq.session_id, tool)
        self.kv.check_integrity()
        return seq

    def turn(self, tokens: list[int], session: str, tool: str | None = None) -> Sequence:
        return self.run(self.start(tokens, session), tool)

    def tail(self, tokens: list[int]) -> list[int]:
        """The device pages caching the full pages of `tokens` past the head."""
        return list(self.kv.lookup(tokens, None).pages)[len(HEAD) // PAGE :]

    def eviction_order(self) -> list[int]:
        """Evict one page at a time until nothing is cached; the pages in eviction order."""
        order: list[int] = []
        cached = {p for p in range(self.kv.num_pages) if self.kv.index.is_cached(p)}
        while self.kv.evict(1):
            now = {p for p in range(self.kv.num_pages) if self.kv.index.is_cached(p)}
            (gone,) = cached - now
            order.append(gone)
            cached = now
            self.kv.check_integrity()
        return order


def goes_before(order: list[int], first: list[int], then: list[int]) -> bool:
    """Whether every page of `first` left before any page of `then`."""
    assert first and then
    position = {page: i for i, page in enumerate(order)}
    return max(position[p] for p in first) < min(position[p] for p in then)


def observe(agents: Agents, tool: str, pauses_s: list[float]) -> None:
    """A throwaway session calls `tool` and comes back after each pause (then is released)."""
    session = f"probe-{tool}"
    tokens = [*HEAD, 90]
    agents.turn(tokens, session, tool)
    for pause_s in pauses_s:
        agents.clock.now_s += pause_s
        tokens = [*tokens, 91]
        agents.turn(tokens, session, tool)
    agents.kv.release_session(session)


def test_the_forecast_uses_the_tool_then_every_tool_then_the_prior() -> None:
    forecast = ReturnForecast(prior_pause_s=2.0)
    assert forecast.remaining_s("grep", 0.5) == pytest.approx(1.5)
    forecast.observe("build", 30.0)
    assert forecast.remaining_s("grep", 10.0) == pytest.approx(20.0)  # every tool's pauses stand in
    forecast.observe("grep", 0.4)
    forecast.observe("grep", 0.6)
    assert forecast.remaining_s("grep", 0.1) == pytest.approx(0.4)
    # Only the longer pauses are still possible.
    assert forecast.remaining_s("grep", 0.5) == pytest.approx(0.1)
    # Past every pause seen, a call is expected to run as long again as it already has.
    assert forecast.remaining_s("grep", 60.0) == pytest.approx(60.0)


def test_a_tool_that_returns_fast_keeps_its_tail_one_that_takes_minutes_lets_it_go() -> None:
    agents = Agents()
    observe(agents, "grep", [0.5, 0.5])
    observe(agents, "build", [90.0, 120.0])
    fast = agents.turn([*HEAD, 10, 11, 12], "fast", "grep")  # pauses first: LRU and `session` evict it first
    agents.clock.now_s += 0.1
    slow = agents.turn([*HEAD, 20, 21, 22], "slow", "build")
    agents.clock.now_s += 0.1
    slow_tail, fast_tail = agents.tail(slow.token_ids), agents.tail(fast.token_ids)
    assert goes_before(agents.eviction_order(), slow_tail, fast_tail)


def test_a_call_that_never_returned_within_a_minute_goes_before_a_slower_tool_just_begun() -> None:
    agents = Agents()
    observe(agents, "test", [0.5, 0.8])
    observe(agents, "fetch", [5.0, 6.0])
    stuck = agents.turn([*HEAD, 10, 11, 12], "stuck", "test")
    agents.clock.now_s += 60.0
    waiting = agents.turn([*HEAD, 20, 21, 22], "waiting", "fetch")
    agents.clock.now_s += 1.0
    stuck_tail, waiting_tail = agents.tail(stuck.token_ids), agents.tail(waiting.token_ids)
    assert goes_before(agents.eviction_order(), stuck_tail, waiting_tail)


def test_a_queued_turn_protects_the_tail_it_continues() -> None:
    agents = Agents()
    first = agents.turn([*HEAD, 10, 11, 12], "a", "grep")
    agents.clock.now_s += 0.1
    other = agents.turn([*HEAD, 20, 21, 22], "b", "grep")
    agents.start([*first.token_ids, 13], "a")  # a's tool returned: its next turn waits for admission
    assert agents.kv.retention.return_in_s("a") == 0.0
    other_tail, first_tail = agents.tail(other.token_ids), agents.tail(first.token_ids)
    assert goes_before(agents.eviction_order(), other_tail, first_tail)


def test_released_and_superseded_pages_still_go_first() -> None:
    agents = Agents()
    released = agents.turn([*HEAD, 10, 11, 12], "done", "grep")
    agents.kv.release_session("done")
    old = agents.turn([*HEAD, 20, 21, 22], "retried", "grep")
    agents.turn([*HEAD, 30, 31, 32], "retried", "grep")  # the retry supersedes the branch above
    agents.clock.now_s += 600.0  # far past any pause: the paused tail scores high, and still goes after them
    paused = agents.tail([*HEAD, 30, 31, 32])
    released_tail, old_tail = agents.tail(released.token_ids), agents.tail(old.token_ids)
    retention = agents.kv.retention
    assert retention.key(agents.kv.index.node(released_tail[0]))[0] == Rank.RELEASED
    assert retention.key(agents.kv.index.node(old_tail[0]))[0] == Rank.SUPERSEDED
    order = agents.eviction_order()
    assert goes_before(order, released_tail, old_tail)
    assert goes_before(order, old_tail, paused)


def test_the_shared_head_is_weighed_by_the_sessions_that_reach_it() -> None:
    agents = Agents()
    observe(agents, "grep", [4.0])
    observe(agents, "test", [3.0])
    a = agents.turn([*HEAD, 10, 11, 12], "a", "grep")
    b = agents.turn([*HEAD, 20, 21, 22], "b", "grep")
    solo = agents.turn([7, 8, 9, 10, 11], "solo", "test")  # another head, back sooner than a and b
    head_pages = list(agents.kv.lookup(HEAD, None).pages)
    solo_pages = list(agents.kv.lookup(solo.token_ids, None).pages)
    tails = agents.tail(a.token_ids) + agents.tail(b.token_ids)
    retention, node = agents.kv.retention, agents.kv.index.node
    assert retention.key(node(tails[0])) == (Rank.PAUSED, pytest.approx(-4.0))
    assert retention.key(node(solo_pages[0])) == (Rank.PAUSED, pytest.approx(-3.0))
    # Two sessions wait on the head: the soonest one's wait, halved.
    assert retention.key(node(head_pages[0])) == (Rank.PAUSED, pytest.approx(-2.0))
    order = agents.eviction_order()
    assert goes_before(order, tails, solo_pages)
    assert goes_before(order, solo_pages, head_pages)  # unweighed, the head (4 s away) would go first


def test_the_session_policy_still_ranks_paused_tails_by_last_activity() -> None:
    agents = Agents("session")
    observe(agents, "grep", [0.5])
    fast = agents.turn([*HEAD, 10, 11, 12], "fast", "grep")
    agents.clock.now_s += 0.1
    slow = agents.turn([*HEAD, 20, 21, 22], "slow", "build")
    fast_tail, slow_tail = agents.tail(fast.token_ids), agents.tail(slow.token_ids)
    assert goes_before(agents.eviction_order(), fast_tail, slow_tail)


def test_a_return_the_caller_knows_replaces_the_forecast_until_the_turn_arrives() -> None:
    agents = Agents()
    observe(agents, "grep", [0.5])
    soon = agents.turn([*HEAD, 10, 11, 12], "soon", "grep")
    late = agents.turn([*HEAD, 20, 21, 22], "late", "grep")
    retention = agents.kv.retention
    assert retention.expect_return("soon", 30.0) and retention.expect_return("late", 90.0)
    assert not retention.expect_return("nobody", 1.0)
    agents.clock.now_s += 10.0
    assert retention.return_in_s("soon") == pytest.approx(20.0)
    assert retention.return_in_s("late") == pytest.approx(80.0)
    soon_tail, late_tail = agents.tail(soon.token_ids), agents.tail(late.token_ids)
    assert goes_before(agents.eviction_order(), late_tail, soon_tail)
    back = agents.start([*soon.token_ids, 13], "soon")  # it came back: due now, the told time forgotten
    assert retention.return_in_s("soon") == 0.0
    agents.run(back, "grep")
    assert retention.return_in_s("soon") == pytest.approx(retention.forecast.remaining_s("grep", 0.0))


def test_a_session_told_it_never_continues_its_pages_goes_first_among_the_paused() -> None:
    agents = Agents()
    compacting = agents.turn([*HEAD, 10, 11, 12], "compacting", "grep")
    agents.clock.now_s += 0.1
    other = agents.turn([*HEAD, 20, 21, 22], "other", "grep")
    agents.kv.retention.expect_return("compacting", math.inf)
    assert agents.kv.retention.return_in_s("compacting") == math.inf
    gone, kept = agents.tail(compacting.token_ids), agents.tail(other.token_ids)
    assert goes_before(agents.eviction_order(), gone, kept)
