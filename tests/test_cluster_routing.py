"""The router's policies over its shadow prefix indexes (swarmkv.cluster.routing): pure Python, no Ray."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmkv.cluster.routing import POLICIES, Decision, Policy, RouteKey, Router

PAGE = 16
IDLE = {"a": 0, "b": 0, "c": 0, "d": 0}


def head(swarm: int, num_tokens: int = 256) -> list[int]:
    """A swarm's distinct head of token ids."""
    return list(range(swarm * 100_000, swarm * 100_000 + num_tokens))


def prompt(swarm: int, agent: int, tail: int = 40) -> RouteKey:
    """The swarm's head then the agent's own tokens, under the agent's session."""
    own = list(range(10_000_000 + agent * 1000, 10_000_000 + agent * 1000 + tail))
    return RouteKey(head(swarm) + own, session=f"s{swarm}-a{agent}")


def router(policy: Policy, pages: int = 1024, **kwargs: int) -> Router:
    """A router with 16-token pages and `pages` per replica."""
    return Router(policy, pages_per_replica=pages, page_size=PAGE, **kwargs)


def test_round_robin_cycles_over_sorted_ids() -> None:
    r = router("round-robin")
    picks = [r.choose(prompt(0, i), {"c": 0, "a": 5, "b": 9}).replica for i in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    assert r.decisions == {("round-robin", "round_robin"): 6}


def test_session_sticks_while_its_replica_is_a_candidate() -> None:
    r = router("session")
    first = r.choose(prompt(0, 0), IDLE)
    assert first.reason == "balance"
    loads = dict(IDLE, **{first.replica: 50})  # stickiness ignores load
    again = r.choose(RouteKey(head(1), session="s0-a0"), loads)  # another prompt, same session id
    assert (again.replica, again.reason) == (first.replica, "session")
    others = {k: v for k, v in IDLE.items() if k != first.replica}
    moved = r.choose(prompt(0, 0), others)  # its replica is gone: re-placed, then sticks to the new one
    assert moved.reason == "balance" and moved.replica != first.replica
    assert r.choose(prompt(0, 0), IDLE).replica == moved.replica


def test_forget_drops_index_and_sessions() -> None:
    r = router("prefix", min_match=PAGE * 4)
    first = r.choose(prompt(0, 0), IDLE)
    assert r.cached_pages(first.replica) > 0
    assert r.choose(prompt(0, 1), IDLE).replica == first.replica
    r.forget(first.replica)
    assert r.cached_pages(first.replica) == 0
    after = r.choose(prompt(0, 2), IDLE)  # nothing matches any more: balance, maybe the same id again
    assert after.reason == "balance" and after.matched_tokens == 0


def test_cold_swarm_lands_on_one_replica_while_others_spread() -> None:
    r = router("prefix")
    loads = dict.fromkeys("abcdefgh", 0)
    by_swarm: dict[int, set[str]] = {}
    for agent in range(8):  # arrivals interleaved, none finished: loads grow as requests land
        for swarm in range(4):
            d = r.choose(prompt(swarm, agent), loads)
            loads[d.replica] += 1
            by_swarm.setdefault(swarm, set()).add(d.replica)
            if agent:
                assert d.reason == "prefix" and d.matched_tokens >= 256 - PAGE
    assert all(len(replicas) == 1 for replicas in by_swarm.values())
    assert len(set.union(*by_swarm.values())) > 1  # distinct swarms were balanced, not piled up


def test_prefix_falls_back_to_balance_when_imbalanced() -> None:
    r = router("prefix", imbalance=2)
    home = r.choose(prompt(0, 0), IDLE).replica
    assert r.choose(prompt(0, 1), dict(IDLE, **{home: 2})).replica == home  # within least + 2
    d = r.choose(prompt(0, 2), dict(IDLE, **{home: 3}))
    assert d.reason == "balance" and d.replica != home


def test_short_match_is_not_a_prefix_decision() -> None:
    r = router("prefix", min_match=128)
    r.choose(RouteKey(head(0, 100)), IDLE)
    d = r.choose(RouteKey(head(0, 100) + [1, 2, 3]), IDLE)
    assert d.reason == "balance"


def test_longest_match_wins_ties_by_load_then_id() -> None:
    r = router("prefix")
    for replica in "ab":  # both replicas get the same head: each was the only candidate once
        assert r.choose(RouteKey(head(0)), {replica: 0}).replica == replica
    longer = head(0) + list(range(7, 7 + 64))
    r.choose(RouteKey(longer), {"b": 0})
    assert r.choose(RouteKey(longer + [1]), {"a": 0, "b": 0}).replica == "b"  # b matches more
    assert r.choose(RouteKey(head(0) + [9] * 20), {"a": 1, "b": 0}).replica == "b"  # equal match: lower load
    assert r.choose(RouteKey(head(0) + [8] * 20), {"a": 0, "b": 0}).replica == "a"  # equal load: lower id


def test_index_is_bounded_and_evicts_lru() -> None:
    r = router("prefix", pages=40, min_match=PAGE)  # 640 tokens: two 256-token heads and change
    only = {"a": 0}
    for swarm in range(3):
        r.choose(RouteKey(head(swarm)), only)
        assert r.cached_pages("a") <= 40
    # Swarm 0 was least recently used: evicted first, swarm 2 stays whole.
    assert r.choose(RouteKey(head(2) + [1]), only).matched_tokens == 256
    assert r.choose(RouteKey(head(0) + [1]), only).matched_tokens < 256
    long = r.choose(
        RouteKey(list(range(9_000_000, 9_005_000))), only
    )  # longer than the index: records what fits
    assert long.matched_tokens == 0 and r.cached_pages("a") <= 40


def test_empty_loads_and_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="empty"):
        router("prefix").choose(prompt(0, 0), {})
    with pytest.raises(ValueError, match="policy"):
        Router("random", pages_per_replica=8)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pages_per_replica"):
        Router("prefix", pages_per_replica=0)
    with pytest.raises(ValueError, match="must be >= 0"):
        Router("prefix", pages_per_replica=8, min_match=-1)


@settings(max_examples=25, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    arrivals=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.integers(0, 6)), max_size=40),
)
def test_decisions_count_every_choice_on_a_candidate(
    policy: Policy, arrivals: list[tuple[int, int, int]]
) -> None:
    r = router(policy, pages=64, min_match=PAGE)
    decisions: list[Decision] = []
    for swarm, agent, load in arrivals:
        loads = {"a": load, "b": 0, "c": 6 - load}
        d = r.choose(prompt(swarm, agent), loads)
        assert d.replica in loads and d.matched_tokens >= 0
        decisions.append(d)
    assert sum(r.decisions.values()) == len(decisions)
    assert all(p == policy for p, _ in r.decisions)


@pytest.mark.parametrize("retention", ["session", "lru"])
def test_the_shadow_index_evicts_with_the_replicas_retention_policy(retention: str) -> None:
    # A paused agent's prompt, then sessionless traffic that fills a replica of 8 pages of 4 tokens twice
    # over. A replica under `session` retention keeps the paused agent's tail (its pages rank above other
    # traffic's); under `lru` it is the oldest, so it goes first. The shadow index must do as its replica does.
    from swarmkv.core.config import EngineConfig
    from swarmkv.core.core import EngineCore

    r = Router("round-robin", pages_per_replica=8, page_size=4, retention=retention)  # type: ignore[arg-type]
    replica = EngineCore(EngineConfig(block_size=4, retention=retention), 8)  # type: ignore[arg-type]
    paused = list(range(1, 9))
    r.choose(RouteKey(paused, session="agent"), {"a": 0})
    replica.prefill("p", paused, session_id="agent")
    for i in range(8):
        other = list(range(100 * (i + 1), 100 * (i + 1) + 8))
        r.choose(RouteKey(other), {"a": 0})
        replica.prefill(f"q{i}", other)
    shadow = r.shadow("a")
    assert shadow is not None and shadow.kv.retention.policy == retention
    kept = shadow.kv.lookup(paused, None).num_tokens
    assert kept == replica.kv.lookup(paused, None).num_tokens
    assert kept == (8 if retention == "session" else 0)
    shadow.check_integrity()
