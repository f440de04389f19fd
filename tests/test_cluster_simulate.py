"""The multi-swarm trace, the cluster simulator over real KV managers, and `swarmkv plan --replicas`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from swarmkv.cli import main
from swarmkv.cluster.simulate import ClusterSpec, reference, simulate, sweep, whole_trace_pages
from swarmkv.cluster.trace import HARNESSES, Trace, TraceConfig, make_trace
from swarmkv.kv.returns import PRIOR_PAUSE_S

SMALL = TraceConfig(
    swarms=12,
    agents=4,
    turns=3,
    head_tokens=300,
    task_tokens=60,
    reply_tokens=40,
    tool_tokens=60,
    window_s=60,
)


@pytest.fixture(scope="module")
def trace() -> Trace:
    return make_trace(SMALL)


def test_trace_is_seeded_and_agents_continue_their_history(trace: Trace) -> None:
    assert make_trace(SMALL) == trace
    assert make_trace(replace(SMALL, seed=1)) != trace
    assert len(trace.requests) == 12 * 4 * 3
    assert [r.arrival_s for r in trace.requests] == sorted(r.arrival_s for r in trace.requests)
    turns = {(r.session, r.turn): r for r in trace.requests}
    for (session, turn), r in turns.items():
        assert r.prompt[: len(trace.heads[r.swarm])] == list(trace.heads[r.swarm])
        if turn:
            before = turns[(session, turn - 1)]
            assert r.prompt[: before.num_prompt_tokens + len(before.reply)] == before.prompt + list(
                before.reply
            )
            assert r.num_prompt_tokens > before.num_prompt_tokens + len(before.reply)
    first_pages = {head[:16] for head in trace.heads}
    assert len(first_pages) == len(trace.heads)  # every swarm's head differs from its first page


def test_trace_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="swarms"):
        TraceConfig(swarms=0)
    with pytest.raises(ValueError, match="turn-gap"):
        TraceConfig(turn_gap_s=1.0)
    with pytest.raises(ValueError, match="trace shape"):
        TraceConfig(shape="browser")  # type: ignore[arg-type]


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_harness_trace_shares_one_head_per_harness_up_to_its_break() -> None:
    config = TraceConfig(swarms=6, agents=3, turns=2, reply_tokens=40, tool_tokens=60, shape="harness")
    trace = make_trace(config)
    assert make_trace(config) == trace and len(trace.requests) == 6 * 3 * 2
    assert len(set(trace.heads)) == len(HARNESSES)  # swarm s runs harness s % 3
    assert len({head[:16] for head in set(trace.heads)}) == len(HARNESSES)
    firsts = {(r.swarm, r.agent): r.prompt for r in trace.requests if r.turn == 0}
    for swarm in range(6):
        harness = HARNESSES[swarm % len(HARNESSES)]
        assert trace.heads[swarm] == trace.heads[swarm % len(HARNESSES)]
        assert len(trace.heads[swarm]) == harness.shared_tokens
        for agent in range(3):
            first = firsts[(swarm, agent)]
            own = len(first) - harness.shared_tokens  # drawn between half and one and a half times
            assert harness.instance_tokens // 2 <= own <= harness.instance_tokens * 3 // 2
        # Two instances of one harness, in one swarm or two, share exactly the head: the break is there.
        assert _common(firsts[(swarm, 0)], firsts[(swarm, 1)]) == harness.shared_tokens
        other = (swarm + len(HARNESSES)) % 6
        assert _common(firsts[(swarm, 2)], firsts[(other, 0)]) == harness.shared_tokens
    assert all(8_000 <= len(p) <= 20_000 for p in firsts.values())
    # One cache holding the trace holds each harness's head once, then each agent's own tokens.
    own = sum(len(r.prompt) - len(trace.heads[r.swarm]) + len(r.reply) for r in trace.requests if r.turn == 1)
    assert trace.num_unique_tokens == sum(h.shared_tokens for h in HARNESSES) + own


def test_harness_trace_on_one_replica_computes_each_harness_head_once() -> None:
    trace = make_trace(TraceConfig(swarms=3, agents=4, turns=1, shape="harness"))
    spec = ClusterSpec(1, 64, page_size=64)
    ref = reference(trace, spec)
    # Every first request but each harness's first reads its harness's head: its whole pages, and the rest of
    # it where that is at least half a page (a partly shared page is copied), never past it.
    whole_pages = sum(h.shared_tokens // 64 * 64 for h in HARNESSES)
    assert 3 * whole_pages <= ref.hit_tokens <= 3 * sum(h.shared_tokens for h in HARNESSES)
    assert ref.head_copies == 1.0
    three = simulate(trace, replace(spec, replicas=3, pages_per_replica=1024), "balanced")
    assert three.hit_tokens <= ref.hit_tokens and sum(three.requests_per_replica) == 12


def test_counts_add_up_and_one_replica_needs_no_policy(trace: Trace) -> None:
    one = simulate(trace, ClusterSpec(1, 200, page_size=16), None)
    assert one.prefill_tokens == one.prompt_tokens - one.hit_tokens
    assert one.prompt_tokens == sum(r.num_prompt_tokens for r in trace.requests)
    assert one.requests_per_replica == (len(trace.requests),)
    assert one.evictions > 0  # 200 pages hold a few swarms, not twelve
    ref = reference(trace, ClusterSpec(1, 200, page_size=16))
    assert ref.evictions == 0 and ref.hit_rate > one.hit_rate
    with pytest.raises(ValueError, match="policy"):
        simulate(trace, ClusterSpec(2, 200), None)
    with pytest.raises(ValueError, match="replicas"):
        ClusterSpec(0, 200)


def test_prefix_routing_holds_the_hit_rate_and_round_robin_falls(trace: Trace) -> None:
    # Enough KV per replica for the whole trace: only routing separates the policies.
    spec = ClusterSpec(1, whole_trace_pages(trace, 16), page_size=16)
    results = sweep(trace, spec, [1, 2, 4, 8], ["prefix", "round-robin"])
    by = {(r.replicas, r.policy): r for r in results}
    single = by[(1, "any")].hit_rate
    assert by[(1, "any")].evictions == 0
    for replicas in (2, 4, 8):
        assert by[(replicas, "prefix")].hit_rate >= single - 0.05
    rr = [single] + [by[(n, "round-robin")].hit_rate for n in (2, 4, 8)]
    assert rr == sorted(rr, reverse=True) and rr[-1] < single - 0.2
    prefix8, rr8 = by[(8, "prefix")], by[(8, "round-robin")]
    assert prefix8.head_copies < rr8.head_copies  # the per-slot waste, one level up, is what prefix avoids
    assert sum(prefix8.requests_per_replica) == len(trace.requests)
    assert sum(prefix8.decisions.values()) == len(trace.requests)


def test_plan_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = [
        "plan",
        "--replicas",
        "1,2",
        "--swarms",
        "3",
        "--agents",
        "2",
        "--turns",
        "2",
        "--head-tokens",
        "200",
    ]
    tiny += ["--replica-kv", "100MiB", "--sim-page-size", "16", "--router-policies", "prefix,round-robin"]
    tiny += ["--sim-workers", "1"]
    plot = tmp_path / "sim.png"
    assert main([*tiny, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "whole trace" in out and "round-robin" in out and "40 pages of 16 tokens" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([*tiny, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["kv_bytes_per_token"] == 160 * 1024 and data["pages_per_replica"] == 40
    assert [(r["replicas"], r["policy"]) for r in data["rows"]] == [
        (1, "any"),
        (2, "prefix"),
        (2, "round-robin"),
    ]
    assert all(
        r["prefill_tokens_computed"] + r["prefix_hit_tokens"] == r["prompt_tokens"] for r in data["rows"]
    )
    assert all(sum(r["prefill_tokens_per_replica"]) == r["prefill_tokens_computed"] for r in data["rows"])
    assert all(len(r["prefill_tokens_per_replica"]) == len(r["requests_per_replica"]) for r in data["rows"])
    assert all(r["p95_queue_delay_s"] >= 0 and r["busy_prefill_tokens_per_s"] > 0 for r in data["rows"])
    # A shape from the flags sets the bytes per token: 2 layers x 1 head x 8 x fp16 = 64 bytes.
    assert main([*tiny, "--json", "--layers", "2", "--kv-heads", "1", "--head-dim", "8"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes_per_token"] == 64
    assert data["trace"]["shape"] == "synthetic"


def test_plan_cli_harness_trace(capsys: pytest.CaptureFixture[str]) -> None:
    flags = [
        "plan",
        "--replicas",
        "2",
        "--swarms",
        "3",
        "--agents",
        "2",
        "--turns",
        "1",
        "--sim-trace",
        "harness",
    ]
    flags += ["--replica-kv", "2000pages", "--router-policies", "balanced", "--sim-workers", "1"]
    assert main(flags) == 0
    assert "harness-shaped" in capsys.readouterr().out
    assert main([*flags, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["trace"]["shape"] == "harness"
    assert all(r["busy_busiest_requests_over_mean"] >= 1.0 for r in data["rows"])
    # Each harness's second instance reads at least the head's whole pages on one replica holding everything.
    assert data["reference"]["prefix_hit_tokens"] >= sum(h.shared_tokens // 64 * 64 for h in HARNESSES)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--replicas", "0"], "replica counts >= 1"),
        (["--replicas=-2,4"], "replica counts >= 1"),
        (["--replicas", "1,two"], "comma-separated integers"),
        (["--replicas", "2", "--swarms", "0"], "swarms must be at least 1"),
        (["--replicas", "2", "--replica-kv", "1KiB"], "holds no page"),
        (["--replicas", "2", "--router-policies", "random"], "--router-policies"),
        (["--replicas", "2", "--sim-page-size", "0"], "--sim-page-size must be at least 1"),
        (["--replicas", "2", "--route-imbalance=-1"], "--route-imbalance must be >= 0"),
        (["--replicas", "2", "--sim-busy", "1.5"], "--sim-busy must be in (0, 1]"),
    ],
)
def test_plan_cli_bad_input_exits_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *flags]) == 2
    assert message in capsys.readouterr().err


def test_return_retention_times_pauses_by_the_trace_not_the_wall(
    trace: Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Under `return` retention a replica evicts by its sessions' expected returns, timed from their pauses. Timed
    # by the wall clock, a replay's pauses were the milliseconds the simulator took, so its figures followed the
    # machine's load; timed by the trace, an agent's pause is its think-and-tool gap, seconds, and runs repeat.
    import swarmkv.cluster.routing as routing
    import swarmkv.cluster.simulate as simulate_module

    built: list[routing.EngineCore] = []

    class Recorded(routing.EngineCore):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            built.append(self)

    monkeypatch.setattr(simulate_module, "EngineCore", Recorded)
    monkeypatch.setattr(routing, "EngineCore", Recorded)
    spec = ClusterSpec(2, 120, page_size=16, retention="return")
    first = simulate(trace, spec, "balanced")
    # A core with no pause observed answers the prior alone.
    pauses = [p for core in built for p in core.kv.retention.forecast.pauses(None) if p != PRIOR_PAUSE_S]
    assert len(pauses) > len(trace.requests) // 2  # replicas' and shadows' sessions both came back
    assert min(pauses) >= 0.0 and sum(pauses) / len(pauses) > 1.0  # seconds of the trace
    assert simulate(trace, spec, "balanced") == first
