"""`swarmkv lint` as a user runs it: the JSON shape, the report, exit codes, malformed lines, --fix."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest_tokenizer_helpers import smol_metadata, smol_tokenizer
from lint_logs import Breakers, agent_requests, write_log
from swarmkv.breaks.causes import CAUSES
from swarmkv.cli import main
from swarmkv.config import ModelConfig
from swarmkv.lint import model as lint_model
from swarmkv.server.observability.request_log import RequestLog

CLASSIC = Breakers(timestamp=True, tool_reorder=True)
SUMMARY_KEYS = {
    "hit_rate",
    "projected_hit_rate",
    "shared_head_tokens",
    "kv_bytes",
    "projected_kv_bytes",
    "causes",
}


@pytest.fixture
def fast_model(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The default model's tokenizer and config, read once per session instead of once per run."""
    model = lint_model.LintModel("SmolLM2", smol_tokenizer(), ModelConfig.from_gguf_metadata(smol_metadata()))
    monkeypatch.setattr(lint_model, "load_lint_model", lambda path: model)
    yield


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["lint", *args])
    out, err = capsys.readouterr()
    return code, out, err


def lint_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code, out, _ = run(capsys, *args, "--json")
    assert code == 0
    return json.loads(out)


def test_json_shape_with_the_real_model_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_log(tmp_path / "log.jsonl", agent_requests(3, 2, CLASSIC))
    report = lint_json(capsys, str(log))
    assert [r["index"] for r in report["requests"]] == list(range(6))
    for r in report["requests"]:
        assert {"index", "session", "prompt_tokens", "cached_tokens", "break"} <= set(r)
        assert 0 <= r["cached_tokens"] < r["prompt_tokens"]
        if r["break"] is not None:
            assert set(r["break"]) == {"offset", "cause", "text"} and r["break"]["cause"] in CAUSES
    assert report["requests"][0]["break"] is None
    assert report["requests"][1]["break"]["cause"] == "timestamp"
    summary = report["summary"]
    assert set(summary) >= SUMMARY_KEYS
    assert list(summary["causes"]) == list(CAUSES)
    assert summary["causes"]["timestamp"] == 5 and summary["causes"]["tool_order"] == 1
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x K and V x 2 bytes, 16 tokens a page.
    assert summary["page_bytes"] == 30 * 3 * 64 * 2 * 2 * 16
    assert summary["kv_bytes"] % summary["page_bytes"] == 0


def test_the_text_report(tmp_path: Path, capsys: pytest.CaptureFixture[str], fast_model: None) -> None:
    log = write_log(tmp_path / "log.jsonl", agent_requests(3, 2, CLASSIC))
    code, out, _ = run(capsys, str(log))
    assert code == 0
    for text in ("family f1", "session", "agent-2", "break: cause", "timestamp", "tool_order (hidden)"):
        assert text in out
    assert "with the fix (f1 rewrite)" in out


def test_fail_under(tmp_path: Path, capsys: pytest.CaptureFixture[str], fast_model: None) -> None:
    clean = write_log(tmp_path / "clean.jsonl", agent_requests(3, 3))
    broken = write_log(tmp_path / "broken.jsonl", agent_requests(3, 3, CLASSIC))
    assert run(capsys, str(clean), "--fail-under", "0.5")[0] == 0
    assert run(capsys, str(broken), "--fail-under", "0.5")[0] == 1
    assert run(capsys, str(broken))[0] == 0  # breaks alone do not fail a lint


def test_bad_input_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = write_log(tmp_path / "log.jsonl", agent_requests(2, 1))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    for args in (
        [str(tmp_path / "missing.jsonl")],
        [str(log), "--model", str(tmp_path / "no-model")],
        [str(empty)],
    ):
        code, out, err = run(capsys, *args)
        assert code == 2 and not out
        assert len(err.strip().splitlines()) == 1 and err.startswith("swarmkv lint: error: ")


def test_malformed_lines_are_reported_and_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fast_model: None
) -> None:
    records = agent_requests(2, 2)
    lines = [json.dumps(r) for r in records]
    lines[1:1] = ["{not json", "[1, 2]", json.dumps({"route": "/v1/embeddings", "body": {}})]
    lines.append(json.dumps({**records[0], "body": {"messages": [{"role": "robot", "content": "beep"}]}}))
    log = tmp_path / "log.jsonl"
    log.write_text("\n".join(lines) + "\n")
    code, out, err = run(capsys, str(log), "--json")
    assert code == 0
    report = json.loads(out)
    assert [s["line"] for s in report["skipped"]] == [2, 3, 4, 8]
    assert "the server would refuse it: messages[0].role" in report["skipped"][-1]["message"]
    assert [r["line"] for r in report["requests"]] == [1, 5, 6, 7]
    assert [line.split(f"{log}:")[1].split(":")[0] for line in err.strip().splitlines()] == [
        "2",
        "3",
        "4",
        "8",
    ]
    code, out, err = run(capsys, str(log), "--strict")
    assert code == 2 and f"{log}:2: not JSON" in err


def test_bare_bodies_lint_like_full_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fast_model: None
) -> None:
    records = agent_requests(3, 2, CLASSIC)
    full = lint_json(capsys, str(write_log(tmp_path / "full.jsonl", records)))
    bare = [{**r["body"], "user": r["session_id"]} for r in records]
    bodies = lint_json(capsys, str(write_log(tmp_path / "bare.jsonl", bare)))
    assert [r["break"] for r in bodies["requests"]] == [r["break"] for r in full["requests"]]
    assert [r["session"] for r in bodies["requests"]] == [f"user:{r['session']}" for r in full["requests"]]


def test_fix_writes_a_log_that_lints_clean(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fast_model: None
) -> None:
    breakers = Breakers(timestamp=True, uuid_nonce=True, tool_reorder=True, private_before_shared=True)
    log = write_log(tmp_path / "log.jsonl", agent_requests(3, 3, breakers))
    fixed = tmp_path / "fixed.jsonl"
    before = lint_json(capsys, str(log), "--fix", str(fixed))
    after = lint_json(capsys, str(fixed))
    assert all(r["break"] is None for r in after["requests"])
    assert after["summary"]["hit_rate"] == pytest.approx(before["summary"]["projected_hit_rate"])
    assert after["summary"]["hit_rate"] > before["summary"]["hit_rate"] + 0.5
    written = [json.loads(line) for line in fixed.read_text().splitlines()]
    assert [set(r) for r in written] == [{"time", "session_id", "route", "body"}] * 9
    assert "Current time" not in written[0]["body"]["messages"][0]["content"]


def test_a_small_kv_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str], fast_model: None) -> None:
    """42 pages of 16 tokens: prompts longer than the pool are refused (null), the rest evict each other."""
    log = write_log(tmp_path / "log.jsonl", agent_requests(3, 4))
    unlimited = lint_json(capsys, str(log))
    page_bytes = unlimited["summary"]["page_bytes"]
    small = lint_json(capsys, str(log), "--kv-cache-memory", str(42 * page_bytes))
    refused = [r for r in small["requests"] if r["cached_tokens"] is None]
    assert refused and all(r["prompt_tokens"] >= 42 * 16 for r in refused)
    assert small["summary"]["peak_kv_bytes"] <= 42 * page_bytes < unlimited["summary"]["peak_kv_bytes"]
    assert small["summary"]["hit_rate"] < unlimited["summary"]["hit_rate"]


def test_two_hundred_requests(tmp_path: Path, capsys: pytest.CaptureFixture[str], fast_model: None) -> None:
    """A smoke test of a larger log (20 agents x 10 turns); bench/lint.py times 1,000 requests of 4K."""
    log = write_log(tmp_path / "log.jsonl", agent_requests(20, 10, CLASSIC, filler_lines=20, reply_lines=4))
    report = lint_json(capsys, str(log))
    assert len(report["requests"]) == 200
    assert report["summary"]["causes"]["timestamp"] == 199 and report["summary"]["causes"]["tool_order"] == 1
    assert report["summary"]["projected_hit_rate"] > 0.8


def test_refused_requests_are_counted_per_route(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fast_model: None
) -> None:
    log = write_log(tmp_path / "log.jsonl", agent_requests(2, 2))
    server_log = RequestLog(log)  # the refusals appended as `swarmkv serve --log-requests` writes them
    server_log.write_refused("/v1/messages", 400, "messages: field required", {"model": "m"})
    server_log.write_refused("/v1/messages", 404, "model 'x' is not served", {"model": "x"})
    server_log.write_refused("/v1/chat/completions", 400, "the body is not JSON", "{not json \ud800")
    server_log.close()
    report = lint_json(capsys, str(log))
    assert len(report["requests"]) == 4 and report["skipped"] == []
    assert report["summary"]["refused"] == {"/v1/messages": 2, "/v1/chat/completions": 1}
    assert [(r["line"], r["status"]) for r in report["refused"]] == [(5, 400), (6, 404), (7, 400)]
    assert report["refused"][0]["error"] == "messages: field required"
    code, out, _ = run(capsys, str(log))
    assert code == 0
    assert "refused 3 requests (/v1/messages 2, /v1/chat/completions 1)" in out
    assert "refused line 6: /v1/messages 404: model 'x' is not served" in out
