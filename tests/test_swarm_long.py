"""`swarmkv swarm --scenario long`: the long workload, the per-policy report, and the run end to end."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType
from rich.console import Console

from conftest_tokenizer_helpers import smol_tokenizer
from swarmkv.cli import main
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.scheduler import Chunk, StepPlan
from swarmkv.core.sequence import Sequence
from swarmkv.swarm.long_cli import parse_policies
from swarmkv.swarm.long_report import long_record, percentile, print_long_table, save_long_plot
from swarmkv.swarm.long_run import POLICIES, KVSample, ModelledClock, PolicyResult
from swarmkv.swarm.long_workload import TOOL_PAUSE_MAX_S, TOOL_PAUSE_MIN_S, build_long_workload, compacted
from swarmkv.swarm.replay import FIXED_REPLY, ReplayExecutor, fixed_replies, load_replies, record_of
from swarmkv.swarm.workload import initial_messages, tool_result_message
from tiny_gguf import write_tiny_gguf

_SMALL = {"agents": 3, "turns": 12, "prefix_tokens": 300, "max_tokens": 16}


def test_long_workload_is_deterministic_with_varied_tools_and_pauses() -> None:
    tok = smol_tokenizer()
    a = build_long_workload(tok, seed=3, max_context_tokens=100_000, **_SMALL)
    assert a == build_long_workload(tok, seed=3, max_context_tokens=100_000, **_SMALL)
    assert build_long_workload(tok, seed=4, max_context_tokens=100_000, **_SMALL) != a
    assert a.swarm.turns == 12 and len(a.swarm.agents) == 3
    pauses = [p for agent in a.pauses_s for p in agent]
    assert len(pauses) == 3 * 11 and all(TOOL_PAUSE_MIN_S <= p <= TOOL_PAUSE_MAX_S for p in pauses)
    assert max(pauses) / min(pauses) > 5  # log-uniform: quick calls and slow ones
    sizes = [len(tok.encode(out)) for agent in a.swarm.agents for _, out in agent.tool_results]
    kinds = {name for agent in a.swarm.agents for name, _ in agent.tool_results}
    assert len(sizes) == 3 * 11 and min(sizes) <= 150 and max(sizes) >= 1000
    assert {"run_tests", "read_file"} <= kinds
    # The context grows by every tool result: the final context counts each of them.
    for agent, context in zip(a.swarm.agents, a.context_tokens, strict=True):
        assert context > 300 + sum(len(tok.encode(out)) for _, out in agent.tool_results)
    assert a.total_context_tokens == sum(a.context_tokens)


def test_subagents_spawn_by_share_and_fit_the_context() -> None:
    tok = smol_tokenizer()
    every = build_long_workload(tok, seed=3, max_context_tokens=1024, subagent_share=1.0, **_SMALL)
    assert (
        len(every.spawned) == 3
        and len(
            build_long_workload(tok, seed=3, max_context_tokens=1024, subagent_share=0.0, **_SMALL).spawned
        )
        == 0
    )
    for i, plan in enumerate(every.subagents):
        assert plan is not None and 0 <= plan.after_turn < 11 and plan.script.agent_id == f"agent-{i}/sub"
        assert len(plan.pauses_s) == len(plan.script.tool_results) in (1, 2)
        messages = initial_messages(every.swarm, plan.script)
        for name, output in plan.script.tool_results:
            messages += [
                {"role": "assistant", "content": "x" * 16},
                {"role": "tool", "name": name, "content": output},
            ]
        assert len(tok.encode(tok.apply_chat_template(messages, tools=list(every.swarm.tools)))) <= 1024
    assert every.compact_tokens == int(0.8 * 1024)


def test_compaction_keeps_the_head_and_drops_the_history() -> None:
    tok = smol_tokenizer()
    long = build_long_workload(tok, seed=3, max_context_tokens=100_000, **_SMALL)
    agent = long.swarm.agents[0]
    messages = initial_messages(long.swarm, agent)
    for turn in range(4):
        messages += [{"role": "assistant", "content": f"reply {turn}"}, tool_result_message(agent, turn)]
    short = compacted(messages)
    assert short[0] == messages[0] and len(short) == 2 and short[1]["role"] == "user"
    assert (
        agent.task in short[1]["content"]
        and "reply 3" in short[1]["content"]
        and "reply 0" not in short[1]["content"]
    )
    assert messages[-1]["content"] in short[1]["content"]
    render = lambda m: tok.encode(tok.apply_chat_template(m, tools=list(long.swarm.tools)))  # noqa: E731
    assert len(render(short)) < len(render(messages))


def test_long_workload_shrinks_tool_results_to_fit_the_context() -> None:
    tok = smol_tokenizer()
    full = build_long_workload(tok, seed=3, max_context_tokens=100_000, **_SMALL)
    fitted = build_long_workload(tok, seed=3, max_context_tokens=2048, **_SMALL)
    assert max(full.context_tokens) > 2048 >= max(fitted.context_tokens)
    assert fitted.pauses_s == full.pauses_s
    for big, small in zip(full.swarm.agents, fitted.swarm.agents, strict=True):
        for (kind, out), (small_kind, small_out) in zip(big.tool_results, small.tool_results, strict=True):
            assert kind == small_kind and out.startswith(small_out)  # trimmed, not regenerated
    with pytest.raises(ValueError, match="lower --turns"):
        build_long_workload(tok, seed=3, max_context_tokens=400, **_SMALL)


def test_policies_parse_in_order_and_refuse_unknown_names() -> None:
    assert list(POLICIES) == ["lru", "session", "return", "session+offload", "belady"]
    assert parse_policies(None) == ["lru", "session", "session+offload"]  # return: named to be compared
    assert parse_policies("session+offload, lru,lru") == ["session+offload", "lru"]
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        parse_policies("lru,fifo")
    with pytest.raises(ValueError, match="unknown policy"):
        parse_policies(",")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policies", "lru,fifo"], "unknown policy 'fifo'"),
        (["--turns", "0"], "must be positive"),
        (["--time-scale", "-0.5"], "--time-scale must be >= 0"),
        (["--mode", "shared"], "--mode is for --scenario short"),
        (["--replay-replies", "r.json"], "--replay-replies takes --clock model"),
    ],
)
def test_long_scenario_rejects_bad_arguments(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["swarm", "--scenario", "long", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_short_scenario_refuses_policies(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["swarm", "--policies", "lru"]) == 2
    assert "--policies is for --scenario long" in capsys.readouterr().err


def _fake(policy: str, recomputed: int, later_ttft_s: float, tokens: list[int]) -> PolicyResult:
    r = PolicyResult(policy, recomputed_tokens=recomputed, pool_bytes=2**20)  # type: ignore[arg-type]
    r.ttft_s = [[0.5, later_ttft_s, later_ttft_s], [0.4, later_ttft_s]]
    r.token_ids = [[tokens, [1]], [[2], [3]]]
    r.timeline = [KVSample(0.1, 1000, 0, 0), KVSample(0.2, 2000, 500, recomputed)]
    return r


_CONFIG = {"agents": 2, "turns": 3, "kv_cache_memory": 2**20, "per_slot_context_bytes": 5 * 2**20}


def test_report_ratios_targets_and_transcripts(tmp_path: Path) -> None:
    results = {
        "lru": _fake("lru", 1000, 2.0, [7, 8]),
        "session": _fake("session", 400, 1.5, [7, 8]),
        "session+offload": _fake("session+offload", 50, 0.5, [7, 8]),
    }
    record = long_record(_CONFIG, results)
    assert set(record) == {"config", "modes", "ratios", "transcripts_identical", "transcripts_compared"}
    assert record["transcripts_identical"] is True
    lru = record["modes"]["lru"]
    assert lru["ttft_p95_later_s"] == 2.0 and lru["ttft_p50_s"] == 2.0 and lru["ttft_p95_s"] == 2.0
    assert record["modes"]["session"]["ttft_p50_s"] == 1.5
    assert record["ratios"] == {
        "session": {"recomputed_tokens": 0.4, "ttft_p95_later_s": 0.75},
        "session+offload": {"recomputed_tokens": 0.05, "ttft_p95_later_s": 0.25},
    }
    assert len({m["transcript_sha256"] for m in record["modes"].values()}) == 1
    json.dumps(record)  # plain JSON throughout
    console = Console(record=True, width=200)
    print_long_table(console, record)
    text = console.export_text()
    assert "0.050x (<= 0.1x)" in text and "0.400x (<= 0.5x)" in text and "0.250x (<= 0.5x)" in text
    assert "WARNING" not in text
    plot = tmp_path / "long.png"
    save_long_plot(str(plot), results)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_flags_different_transcripts_and_missing_lru() -> None:
    results = {"lru": _fake("lru", 0, 1.0, [7, 8]), "session": _fake("session", 0, 1.0, [7, 9])}
    record = long_record(_CONFIG, results)
    assert record["transcripts_identical"] is False
    assert record["ratios"]["session"]["recomputed_tokens"] is None  # lru recomputed nothing: no ratio
    console = Console(record=True, width=200)
    print_long_table(console, record)
    assert "WARNING: the policies generated different tokens" in console.export_text()
    assert long_record(_CONFIG, {"session": results["session"]})["ratios"] == {}


def test_different_transcripts_are_reported_not_failed_where_numerics_round() -> None:
    """int8 activations: a recomputed prefix comes from a prefill, so transcripts may differ; the report says so
    without the warning, and the record says they were not compared."""
    results = {"lru": _fake("lru", 0, 1.0, [7, 8]), "session": _fake("session", 0, 1.0, [7, 9])}
    record = long_record(_CONFIG, results, exact_numerics=False)
    assert record["transcripts_identical"] is False and record["transcripts_compared"] is False
    console = Console(record=True, width=200)
    print_long_table(console, record)
    text = console.export_text()
    assert "WARNING" not in text and "transcripts differ, as they may here" in text


def test_exact_numerics_is_float32_without_int8_decodes(tmp_path: Path) -> None:
    from swarmkv.core.config import EngineConfig
    from swarmkv.models.loader import load_model
    from swarmkv.swarm.long_cli import exact_numerics

    path = write_tiny_gguf(tmp_path / "q8.gguf", projections=GGMLQuantizationType.Q8_0)
    held = load_model(path, dtype="float32")
    assert not exact_numerics(held, EngineConfig())  # the C step rounds activations to int8
    assert exact_numerics(held, EngineConfig(cpu_int8_activations=False))
    assert exact_numerics(held, EngineConfig(fused_cpu_decode=False))
    assert exact_numerics(load_model(path, dtype="float32", weights="float"), EngineConfig())
    assert not exact_numerics(load_model(path, dtype="bfloat16", weights="float"), EngineConfig())


def test_percentile_interpolates() -> None:
    assert percentile([], 95) is None
    assert percentile([3.0], 95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 95) == pytest.approx(9.5)


@pytest.mark.model
@pytest.mark.slow
def test_long_swarm_end_to_end(tmp_path: Path) -> None:
    out, plot = tmp_path / "long.json", tmp_path / "long.png"
    # Sized for a CPU: each agent's context grows to at most 640 tokens (29 MiB of KV), three of them
    # share a 32 MiB pool, and a decode step of the default model costs a few hundred milliseconds.
    args = ["swarm", "--scenario", "long", "--agents", "3", "--turns", "6", "--prefix-tokens", "200"]
    args += ["--max-tokens", "4", "--max-model-len", "640", "--kv-cache-memory", "32MiB"]
    args += ["--offload-memory", "1GiB", "--time-scale", "0.01", "--weights", "float"]
    start = time.perf_counter()
    assert main([*args, "--json", str(out), "--plot", str(plot)]) == 0
    print(f"long swarm end to end: {time.perf_counter() - start:.1f} s")
    record = json.loads(out.read_text())
    assert set(record["modes"]) == {"lru", "session", "session+offload"}
    assert record["transcripts_identical"] is True
    assert record["config"]["turns"] == 6 and max(record["config"]["context_tokens"]) <= 640
    for mode in record["modes"].values():
        for key in (
            "prefill_tokens_computed",
            "recomputed_tokens",
            "prefix_hit_tokens",
            "evictions",
            "offload_loads",
            "offload_load_bytes",
            "ttft_p50_s",
            "ttft_p95_s",
            "ttft_p95_later_s",
            "wall_s",
            "transcript_sha256",
            "swap_preemptions",
            "recompute_preemptions",
            "preemptions",
            "peak_kv_bytes",
            "pool_bytes",
        ):
            assert key in mode
        # Agents first (six turns each), then the subagents they spawned (two or three turns each).
        rows = mode["ttft_s"]
        assert len(rows) == 3 + record["config"]["subagents"] == 3 + mode["subagents"]
        assert all(len(turns) == 6 for turns in rows[:3]) and all(len(t) in (2, 3) for t in rows[3:])
        assert mode["pool_bytes"] <= 32 * 2**20
    lru, offload = record["modes"]["lru"], record["modes"]["session+offload"]
    # The pool is too small for every context: lru evicts pages that later turns compute again.
    assert lru["evictions"] > 0 and lru["recomputed_tokens"] > 0
    assert offload["recomputed_tokens"] <= lru["recomputed_tokens"]
    assert set(record["ratios"]) == {"session", "session+offload"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_modelled_clock_moves_by_steps_and_jumps_waits() -> None:
    clock = ModelledClock(step_s=0.03, token_s=0.001)
    clock.stepped(100)
    assert clock.now() == pytest.approx(0.13)
    clock.wait_until(2.0)
    assert clock.now() == 2.0
    clock.wait_until(1.0)  # never backwards
    assert clock.now() == 2.0


def test_a_replay_gives_the_recorded_tokens_and_a_draft_as_far_as_it_matches(tmp_path: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=0.0)
    seq = Sequence("agent-0/turn-0", [1, 2, 3], params)
    executor = ReplayExecutor({"agent-0/turn-0": [7, 8, 9, 10]})
    prefill = Chunk(seq, 0, [1, 2, 3], "prefill", samples=True)
    quiet = Chunk(Sequence("other", [4, 5], params), 0, [4], "prefill", samples=False)
    assert [r.token_ids for r in executor.execute(StepPlan(chunks=[quiet, prefill]), None).rows] == [[7]]
    seq.append_token(7)
    draft = Chunk(seq, 3, [7, 8, 5], "decode", samples=True, draft=(8, 5))  # 8 matches, 5 does not
    assert executor.execute(StepPlan(chunks=[draft]), None).rows[0].token_ids == [8, 9]
    for token in (8, 9, 10):
        seq.append_token(token)
    with pytest.raises(RuntimeError, match="more tokens than its run generated"):
        executor.execute(StepPlan(chunks=[Chunk(seq, 6, [10], "decode", samples=True)]), None)
    settings = {"agents": 1, "turns": 2, "seed": 0, "max_tokens": 8, "max_model_len": 64}
    settings |= {"prefix_tokens": 10, "subagent_share": 0.0}
    path = tmp_path / "replies.json"
    path.write_text(json.dumps(record_of(settings, ["agent-0"], [[[7, 8], [9]]])))
    assert load_replies(str(path), settings) == {"agent-0/turn-0": [7, 8], "agent-0/turn-1": [9]}
    with pytest.raises(ValueError, match="recorded with other settings"):
        load_replies(str(path), {**settings, "seed": 1})


def test_fixed_replies_give_every_request_the_same_text_to_max_tokens() -> None:
    tokenizer = smol_tokenizer()
    replies = fixed_replies(tokenizer, 16)
    first, other = replies["agent-0/turn-0"], replies["agent-3/sub/turn-2"]
    assert first == other and len(first) == 16
    assert tokenizer.decode(first).startswith(FIXED_REPLY)
