"""The multi-swarm trace, the cluster simulator over real KV managers, and `swarmkv plan --replicas`."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from swarmkv.cli import main
from swarmkv.cluster.simulate import ClusterSpec, reference, simulate, sweep, whole_trace_pages
from swarmkv.cluster.trace import Trace, TraceConfig, make_trace

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
