"""The swarm workload and `swarmkv swarm`: deterministic, templated, and sharing that is ideal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest_tokenizer_helpers import smol_tokenizer
from swarmkv.cli import build_parser, main
from swarmkv.core.config import EngineConfig
from swarmkv.models.loader import LoadedModel, load_model
from swarmkv.swarm.cli import selected_modes
from swarmkv.swarm.run import run_swarm
from swarmkv.swarm.workload import build_workload, initial_messages, prefix_token_count, tool_result_message


@pytest.mark.parametrize("target", [300, 1000, 2000, 3000])
def test_prefix_length_is_within_five_percent(target: int) -> None:
    tok = smol_tokenizer()
    w = build_workload(tok, agents=3, prefix_tokens=target)
    measured = prefix_token_count(tok, w.system_prompt, w.tools)
    assert abs(measured - target) <= 0.05 * target


def test_workload_is_deterministic_and_private_after_the_head() -> None:
    tok = smol_tokenizer()
    a, b = build_workload(tok, seed=4), build_workload(tok, seed=4)
    assert a == b
    assert build_workload(tok, seed=5).agents != a.agents
    assert len({s.task for s in a.agents}) == len(a.agents)
    assert len(a.tools) == 12 and {t["function"]["name"] for t in a.tools} >= {
        "read_file",
        "run_command",
        "git_diff",
    }


def test_prompts_are_rendered_through_the_chat_template_with_tools() -> None:
    tok = smol_tokenizer()
    w = build_workload(tok, agents=2, turns=3, prefix_tokens=800)
    agent = w.agents[0]
    messages = initial_messages(w, agent)
    text = tok.apply_chat_template(messages, tools=list(w.tools))
    assert text.startswith("<|im_start|>system\n" + w.system_prompt)
    assert '"name": "read_file"' in text and text.endswith("<|im_start|>assistant\n")
    messages += [{"role": "assistant", "content": "Reading the file."}, tool_result_message(agent, 0)]
    later = tok.apply_chat_template(messages, tools=list(w.tools))
    assert later.startswith(
        text[: -len("<|im_start|>assistant\n")]
    )  # a later turn extends the earlier prompt
    assert len(tok.encode(agent.tool_results[0][1])) > 100


@pytest.mark.model
@pytest.mark.slow
def test_swarm_command_reports_ideal_sharing(tmp_path: Path) -> None:
    out, plot = tmp_path / "swarm.json", tmp_path / "swarm.png"
    # float32 weights: the replies, which later turns' prompts hold, are then the same in both modes, so the
    # two modes' contexts are equal and the bounds below are the sharing's alone (int4 rounding depends on
    # the shapes a mode computes, and on the CPU).
    args = ["swarm", "--agents", "3", "--turns", "2", "--prefix-tokens", "300", "--max-tokens", "3"]
    args += ["--weights", "float"]
    assert main([*args, "--block-size", "32", "--json", str(out), "--plot", str(plot)]) == 0
    record = json.loads(out.read_text())
    assert set(record["modes"]) == {"shared", "per_slot"}
    config, shared, per_slot = record["config"], record["modes"]["shared"], record["modes"]["per_slot"]
    for key in ("agents", "turns", "kv_bytes_per_token", "shared_prefix_tokens", "cascade_attention"):
        assert key in config
    assert config["block_size"] == 32
    for mode in (shared, per_slot):
        for key in (
            "peak_kv_bytes",
            "final_kv_bytes",
            "prompt_tokens",
            "prefill_tokens_computed",
            "prefix_hit_tokens",
            "recomputed_tokens",
            "cascade_decode_rows",
            "wall_s",
            "ttft_s",
            "decode_tokens_per_s",
        ):
            assert key in mode
        assert len(mode["ttft_s"]) == 3 and all(len(turns) == 2 for turns in mode["ttft_s"])
        # Each turn's first token is sampled in the step that finishes its prefill, never a decode-only one.
        assert 0 < mode["decode_tokens"] <= mode["generated_tokens"] - 3 * 2
        assert mode["recomputed_tokens"] == 0  # the pool holds every context: nothing is evicted
    head_pages = config["shared_prefix_tokens"] // config["block_size"]
    page_bytes = config["block_size"] * config["kv_bytes_per_token"]
    assert (
        per_slot["peak_kv_bytes"] - shared["peak_kv_bytes"]
        >= (config["agents"] - 1) * head_pages * page_bytes
    )
    saved = per_slot["prefill_tokens_computed"] - shared["prefill_tokens_computed"]
    assert saved >= (config["agents"] - 1) * head_pages * config["block_size"]
    assert set(record["ratios"]) >= {"peak_kv_bytes", "prefill_tokens_computed", "wall_s"}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_modes_select_the_layouts_and_the_removed_naive_alias_is_refused() -> None:
    args = build_parser().parse_args(["swarm", "--mode", "per-slot"])
    assert selected_modes(args.mode) == ["per-slot"]
    assert selected_modes("both") == ["shared", "per-slot"] and selected_modes("shared") == ["shared"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["swarm", "--mode", "naive"])


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    return load_model()


@pytest.mark.model
def test_decode_throughput_counts_only_decode_only_steps(loaded: LoadedModel) -> None:
    workload = build_workload(loaded.tokenizer, agents=2, turns=1, prefix_tokens=100, max_tokens=4)
    r = run_swarm(loaded, workload, "per-slot", EngineConfig(kv_cache_memory="64MiB"))
    # Both prompts fit the first step, which samples each one's first token; every later step only decodes.
    assert r.generated_tokens > 2
    assert r.decode_tokens == r.generated_tokens - 2 and r.decode_s > 0
    assert r.decode_tokens_per_s == r.decode_tokens / r.decode_s


@pytest.mark.model
def test_swarm_passes_engine_options_through(loaded: LoadedModel) -> None:
    workload = build_workload(loaded.tokenizer, agents=2, turns=1, prefix_tokens=100, max_tokens=4)
    # max_num_seqs=1 is overridden: the swarm runs one request per agent at once.
    config = EngineConfig(kv_cache_memory="64MiB", cascade_attention="on", max_num_seqs=1)
    r = run_swarm(loaded, workload, "shared", config)
    # The two agents decode side by side over the shared head and read it once: "auto" would not group
    # a head this short, so the rows show that the option reached the engine.
    assert r.cascade_decode_rows > 0


def test_swarm_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["swarm", "--agents", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "positive" in err[0]


@pytest.mark.model
@pytest.mark.e2e
@pytest.mark.slow
def test_swarm_over_http_reports_cached_tokens(tmp_path: Path) -> None:
    from swarmkv import LLM
    from swarmkv.server import ServerConfig, create_app
    from swarmkv.server.background import BackgroundServer

    out = tmp_path / "http.json"
    llm = LLM(kv_cache_memory="256MiB", max_model_len=2048)
    with BackgroundServer(create_app(llm, ServerConfig(served_model_name="smol"))) as server:
        args = ["swarm", "--server", server.url, "--model", "smol", "--agents", "2", "--turns", "2"]
        assert main([*args, "--prefix-tokens", "300", "--max-tokens", "3", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "smol" and report["summary"]["requests"] == 4
    # The second agent's first turn and every later turn hit the shared head and the agent's own turns.
    assert report["summary"]["cached_tokens"] >= 3 * (300 // 16 * 16)
    assert all(t["ttft_s"] is not None for turns in report["agent_turns"] for t in turns)


def test_swarm_over_an_unreachable_server_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "swarm",
        "--server",
        "http://127.0.0.1:9",
        "--agents",
        "1",
        "--turns",
        "1",
        "--prefix-tokens",
        "50",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("swarmkv swarm: error: cannot talk to http://127.0.0.1:9") and "\n" not in err
