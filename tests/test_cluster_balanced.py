"""The balanced routing policy (swarmkv.cluster.load_policy) and the simulator's load figures: no model, no Ray."""

from __future__ import annotations

from collections import Counter

import pytest

from swarmkv.cluster.load_policy import Candidate, LoadThresholds, pick
from swarmkv.cluster.routing import RouteKey, Router
from swarmkv.cluster.simulate import ClusterSpec, busy_prefill_rate, percentile, simulate, sweep
from swarmkv.cluster.trace import TraceConfig, make_trace

T = LoadThresholds(overload_tokens=1000, overload_ratio=1.5, running_tokens=100)
PROMPT = 2400  # a head of 2,000 tokens and an agent's 400


def c(replica: str, work: float, matched: int = 0, routed: int = 0) -> Candidate:
    return Candidate(replica, work, matched, routed)


def test_affinity_under_balance() -> None:
    # The replica holding the head is somewhat busier, but below both thresholds: the head wins.
    assert pick([c("a", 900, matched=2000), c("b", 0), c("c", 100)], PROMPT, None, T) == ("a", "prefix")


def test_load_wins_past_both_thresholds_and_the_head_is_copied() -> None:
    # 1,200 tokens over the least (> 1,000) and over 1.5x it: overloaded, so the head is copied elsewhere.
    assert pick([c("a", 1200, matched=2000), c("b", 0), c("c", 100)], PROMPT, None, T) == ("b", "replicate")
    # Past the absolute threshold but not the relative one (3,000 < 1.5 x 2,500): still the head's replica.
    assert pick([c("a", 3000, matched=2000), c("b", 2500)], PROMPT, None, T) == ("a", "prefix")


def test_work_saved_is_weighed_against_queue_below_the_thresholds() -> None:
    # Neither is overloaded, but the head's replica queues more than the head would cost to compute again.
    lax = LoadThresholds(overload_tokens=10_000, overload_ratio=2.0)
    assert pick([c("a", 5000, matched=2000), c("b", 2500)], PROMPT, None, lax) == ("b", "replicate")


def test_cold_prompt_goes_to_the_least_loaded_then_the_least_routed() -> None:
    assert pick([c("a", 300), c("b", 0, routed=9), c("c", 0, routed=2)], PROMPT, None, T) == ("c", "balance")


def test_a_session_stays_unless_its_replica_is_overloaded() -> None:
    home = c("a", 900, matched=2300)
    assert pick([home, c("b", 0, matched=2000)], PROMPT, "a", T) == ("a", "session")
    moved = pick([c("a", 1500, matched=2300), c("b", 0, matched=2000)], PROMPT, "a", T)
    assert moved == ("b", "moved")
    # A session whose replica no longer holds its prefix is placed like any request, not counted as moved.
    assert pick([c("a", 0), c("b", 0, matched=2000)], PROMPT, "a", T) == ("b", "prefix")


def test_a_new_session_passes_over_a_crowded_replica_and_a_bound_one_stays() -> None:
    # Sessions bound: a 30, b 10, c 14 (mean 18): a is 12 over the mean (> 8) and over 1.1x it: crowded.
    crowded = [Candidate("a", 0, 2000, 0, 30), Candidate("b", 0, 0, 0, 10), Candidate("c", 100, 0, 0, 14)]
    assert pick(crowded, PROMPT, None, T) == ("a", "prefix")  # not a new session: prefill cost alone
    assert pick(crowded, PROMPT, None, T, new_session=True) == ("b", "replicate")
    # An agent whose KV is on the crowded replica stays: moving it would compute its whole prompt again.
    at_home = [Candidate("a", 0, 2300, 0, 30), Candidate("b", 0, 0, 0, 10), Candidate("c", 0, 0, 0, 14)]
    assert pick(at_home, PROMPT, "a", T) == ("a", "session")
    # Within the absolute slack a swarm's agents keep together (a: 25, 7 over the mean of 18).
    close = [Candidate("a", 0, 2000, 0, 25), Candidate("b", 0, 0, 0, 15), Candidate("c", 0, 0, 0, 14)]
    assert pick(close, PROMPT, None, T, new_session=True) == ("a", "prefix")


def test_router_spreads_new_agents_of_a_widely_shared_head() -> None:
    # One head for every agent (a harness's), no queue anywhere: prefill cost alone sends all to one replica.
    head = list(range(1000, 3000))
    spread = LoadThresholds(crowded_sessions=2, crowded_ratio=1.0)
    for thresholds, least, most in ((LoadThresholds(crowded_sessions=10**6), 24, 24), (spread, 8, 10)):
        router = Router("balanced", pages_per_replica=2048, page_size=16, thresholds=thresholds)
        placed: Counter[str] = Counter()
        for agent in range(24):
            tail = list(range(100_000 * (agent + 1), 100_000 * (agent + 1) + 300))
            key = RouteKey([*head, *tail], session=f"s{agent}")
            placed[router.choose(key, {"a": 0, "b": 0, "c": 0}).replica] += 1
        assert least <= max(placed.values()) <= most, placed


def test_a_new_session_passes_over_a_replica_crowded_in_prefill() -> None:
    # Ten sessions each, but a's brought 40,000 prefill tokens and b's and c's 4,000 (mean 16,000): a is 24,000
    # over the mean (> 8,192) and over 1.1x it, so a new session copies the head to b rather than join a.
    cands = [
        Candidate(r, 0, m, 0, 10, p) for r, m, p in (("a", 2000, 40_000), ("b", 0, 4000), ("c", 0, 4000))
    ]
    assert pick(cands, PROMPT, None, T, new_session=True) == ("b", "replicate")
    assert pick(cands, PROMPT, None, T) == ("a", "prefix")  # not a new session: prefill cost alone
    # 6,000 over the mean is within the absolute threshold: the head's replica still takes it.
    near = [
        Candidate(r, 0, m, 0, 10, p) for r, m, p in (("a", 2000, 22_000), ("b", 0, 13_000), ("c", 0, 13_000))
    ]
    assert pick(near, PROMPT, None, T, new_session=True) == ("a", "prefix")


def test_router_balances_prefill_between_heads_whose_agents_cost_unequally() -> None:
    # Two heads, one harness's agents each bring 3,000 tokens of their own, the other's 50. Balanced in sessions
    # alone, each head's replica keeps its agents and computes nearly all the prefill; with the prefill rule, the
    # busiest replica stays within about the threshold and one agent of the mean (about 21,000 tokens here).
    heads = {"x": list(range(1000, 3000)), "y": list(range(5000, 7000))}
    own = {"x": 3000, "y": 50}
    skews = []
    for prefill_rule in (10**9, 4096):
        thresholds = LoadThresholds(crowded_sessions=10**6, crowded_prefill_tokens=prefill_rule)
        router = Router("balanced", pages_per_replica=4096, page_size=16, thresholds=thresholds)
        computed: Counter[str] = Counter()
        for agent in range(24):
            harness = "xy"[agent % 2]
            tail = list(range(100_000 * (agent + 1), 100_000 * (agent + 1) + own[harness]))
            key = RouteKey([*heads[harness], *tail], session=f"{harness}{agent}")
            decision = router.choose(key, {"a": 0, "b": 0})
            computed[decision.replica] += len(key.tokens) - decision.matched_tokens
        skews.append(max(computed.values()) * 2 / sum(computed.values()))
    assert skews[0] > 1.8 and skews[1] < 1.4, skews


def test_thresholds_are_checked() -> None:
    with pytest.raises(ValueError, match="overload_ratio"):
        LoadThresholds(overload_ratio=0.5)
    with pytest.raises(ValueError, match="crowded_ratio"):
        LoadThresholds(crowded_ratio=0.9)
    with pytest.raises(ValueError, match="crowded_prefill_tokens"):
        LoadThresholds(crowded_prefill_tokens=-1)
    with pytest.raises(ValueError, match="no replica"):
        pick([], PROMPT, None, T)


def test_router_balanced_follows_the_head_then_copies_it_under_load() -> None:
    router = Router("balanced", pages_per_replica=512, page_size=16, thresholds=T)
    head = list(range(1000, 3000))

    def key(agent: int) -> RouteKey:
        return RouteKey(
            [*head, *range(100_000 * (agent + 1), 100_000 * (agent + 1) + 300)], session=f"s{agent}"
        )

    idle = {"a": 0, "b": 0}
    first = router.choose(key(0), idle)
    assert first.reason == "balance"
    other = "b" if first.replica == "a" else "a"
    second = router.choose(key(1), idle, {first.replica: 500.0})
    assert (second.replica, second.reason) == (first.replica, "prefix") and second.matched_tokens >= 1984
    copied = router.choose(key(2), idle, {first.replica: 5000.0})
    assert (copied.replica, copied.reason) == (other, "replicate")
    assert router.choose(key(1), idle, {first.replica: 500.0}).reason == "session"
    moved = router.choose(key(1), idle, {first.replica: 5000.0})
    assert (moved.replica, moved.reason) == (other, "moved")
    assert router.decisions[("balanced", "moved")] == 1


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.95) == 0.0
    assert percentile([float(i) for i in range(1, 101)], 0.95) == 95.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0


def test_simulator_reports_load_per_replica_and_queueing() -> None:
    trace = make_trace(
        TraceConfig(swarms=8, agents=3, turns=2, head_tokens=300, task_tokens=60, window_s=30, seed=2)
    )
    spec = ClusterSpec(4, pages_per_replica=400, page_size=16)
    result = simulate(trace, spec, "balanced")
    assert sum(result.requests_per_replica) == len(trace.requests)
    assert sum(result.prefill_tokens_per_replica) == result.prefill_tokens
    requests, prefill = result.requests_per_replica, result.prefill_tokens_per_replica
    assert result.request_skew == pytest.approx(max(requests) * 4 / sum(requests))
    assert result.prefill_skew == pytest.approx(max(prefill) * 4 / sum(prefill))
    assert result.prefill_tokens_per_s == spec.prefill_tokens_per_s
    # The busy twin runs slower prefill, so requests wait longer; its rate keeps the given work that busy.
    rate = busy_prefill_rate(trace, result.prefill_tokens, 4, 0.8)
    rows = sweep(trace, spec, [4], ["balanced", "prefix"], busy=(result.prefill_tokens, 0.8))
    assert [r.policy for r in rows] == ["balanced", "prefix"]
    assert rows[0].hit_tokens == result.hit_tokens  # the light run's figures stand
    assert rows[0].prefill_tokens_per_s == pytest.approx(rate)
    assert rows[0].p95_queue_delay_s > result.p95_queue_delay_s and rows[0].busy_hit_rate is not None
    assert rows[0].busy_request_skew is not None and rows[0].busy_request_skew >= 1.0
    assert rows[0].busy_prefill_skew is not None and rows[0].busy_prefill_skew >= 1.0
    with pytest.raises(ValueError, match="busy"):
        busy_prefill_rate(trace, 100, 4, 0.0)
