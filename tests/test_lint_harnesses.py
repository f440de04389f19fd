"""`swarmkv lint` on real harness logs: Claude Code, Codex and Qwen Code, two instances each in one log
(lint_harnesses.jsonl), linted with the Qwen3 tokenizer, whose template renders a tool block.

Families are never mixed, each harness's per-instance break is found and named alike, the projected fix is
never below today, and the report fits 80 columns."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from lint_logs import HARNESS_LOG, HARNESSES, SECOND_INSTANCE, harness_log, second_instance
from swarmkv.lint.log_file import LoggedRequest, read_log
from swarmkv.lint.render import Renderer
from swarmkv.lint.report import print_report, to_json
from swarmkv.lint.run import LintResult, lint_log
from swarmkv.tokenizer import Tokenizer

PAGE_SIZE, PAGE_BYTES = 16, 4096
# Where each harness's second instance first parts from its first, and what is behind that.
FIRST_BREAK = {
    "claude": "path /tmp/\u2026/-tmp-harness-research-ws-claude-2/memory/",  # its memory folder, in the system prompt
    "codex": "working directory /tmp/harness-research/ws-codex-2",  # <cwd> in the first user turn
    "qwen": "git hash b07f2d9",  # the git snapshot in the system prompt
}
HIDDEN_BREAKS = {
    "claude": ["working directory /tmp/harness-research/ws-claude-2"],
    "codex": [],
    "qwen": [
        "path /tmp/\u2026/projects/-tmp-harness-research-ws-qwen-2/memory",
        "path /tmp/\u2026/-tmp-harness-research-ws-qwen-2/memory/MEMORY.md",
        "working directory /tmp/harness-research/ws-qwen-2",
    ],
}
SHORT_SESSIONS = {"claude": ("e54ea063", "6f1a0c2e")}  # the session_id inside Claude Code's user_id JSON


def harness_of(index: int) -> str:
    """The log's order: instance 1 of each harness, instance 2 of each, then each's second request."""
    return HARNESSES[index % len(HARNESSES)]


def logged(records: list[dict[str, Any]]) -> list[LoggedRequest]:
    return [
        LoggedRequest(i, i + 1, r["route"], r["body"], r["session_id"], r["time"])
        for i, r in enumerate(records)
    ]


def lint(tok: Tokenizer, records: list[dict[str, Any]]) -> LintResult:
    # The log's server ran the template's order (the default before auto meant tools-first on every API):
    # linted as that server served it, so that tools-first stays a fix to find.
    return lint_log(logged(records), tok, PAGE_SIZE, PAGE_BYTES, check=True, prompt_layout="template")


@pytest.fixture(scope="module")
def mixed(qwen: Tokenizer) -> LintResult:
    return lint(qwen, harness_log())


def test_the_fixture_is_two_instances_of_each_harness() -> None:
    records = harness_log()
    assert len(records) == 12
    for i, record in enumerate(records):
        instance, turn = i // 3 % 2, i // 6
        if instance == 1:
            first = records[i - 3]
            assert {**second_instance(harness_of(i), [first])[0], "time": record["time"]} == record
            assert record["body"] != first["body"]
        if turn == 1:  # the tool round trip continues the same instance's first request
            messages = record["body"]["messages"]
            assert messages[: len(records[i - 6]["body"]["messages"])] == records[i - 6]["body"]["messages"]
    workspaces = [k for harness in HARNESSES for k in SECOND_INSTANCE[harness] if k.startswith("ws-")]
    assert all(any(w in json.dumps(r) for r in records) for w in workspaces)


def test_families_are_never_mixed(mixed: LintResult, qwen: Tokenizer) -> None:
    assert len(mixed.families) == 3
    for family in mixed.families:
        members = [r.index for r in mixed.requests if r.family == family.family.name]
        assert len(members) == 4 and len({harness_of(i) for i in members}) == 1
    by_harness = {harness_of(r.index): r.family for r in mixed.requests}
    assert [by_harness[h] for h in HARNESSES] == ["f1", "f2", "f3"]
    descriptions = [f.family.description for f in mixed.families]
    assert descriptions[0].startswith("You are a Claude agent")
    assert descriptions[1].startswith("You are a coding agent running in the Codex")
    assert descriptions[2].startswith("You are Qwen Code")
    # Never compared across families: each harness linted alone finds the same breaks at the same offsets.
    records = harness_log()
    for number, harness in enumerate(HARNESSES):
        indexes = [i for i in range(len(records)) if harness_of(i) == harness]
        alone = lint(qwen, [records[i] for i in indexes])
        in_mixed = [mixed.requests[i] for i in indexes]
        assert [(r.brk, r.hidden) for r in alone.requests] == [(r.brk, r.hidden) for r in in_mixed]
        assert alone.families[0].hit_rate == pytest.approx(mixed.families[number].hit_rate)


@pytest.mark.parametrize("harness", HARNESSES)
def test_each_per_instance_break_is_found_and_named_alike(
    mixed: LintResult, qwen: Tokenizer, harness: str
) -> None:
    requests = [r for r in mixed.requests if harness_of(r.index) == harness]
    broken = [r for r in requests if r.brk is not None]
    assert [r.index for r in broken] == [3 + HARNESSES.index(harness)]  # instance 2's first request
    brk = broken[0].brk
    assert brk is not None and brk.cause == "per_instance_env"
    assert brk.detail == FIRST_BREAK[harness]
    assert [b.detail for b in broken[0].hidden] == HIDDEN_BREAKS[harness]
    assert all(b.cause == "per_instance_env" for b in broken[0].hidden)
    assert brk.offset == mixed.families[HARNESSES.index(harness)].shared_head_tokens
    # The evidence is the later prompt's text at the break, from a word's start to a word break.
    record = harness_log()[broken[0].index]
    text = Renderer(qwen).render(logged([record])[0]).prompt.text
    for found in (brk, *broken[0].hidden):
        at = text.find(found.text)
        assert at > 0 and not found.text[0].isspace(), found
        assert not (text[at - 1].isalnum() and found.text[0].isalnum()), found  # not inside a word
        end = at + len(found.text)
        assert end == len(text) or not (text[end - 1].isalnum() and text[end].isalnum()), found


def test_the_projected_fix_is_never_below_today(mixed: LintResult) -> None:
    assert mixed.projected_hit_rate >= mixed.hit_rate + 0.05
    for family in mixed.families:
        assert family.projected_hit_rate >= family.hit_rate
        assert set(family.candidates) == {"tools-first", "rewrite", "rewrite+tools-first"}
    claude, codex, qwen = mixed.families
    # The per-instance lines moved below the shared head share the most; the server's tools-first layout
    # alone helps too, and is offered with its rate.
    for family in (claude, qwen):
        assert family.fix == "rewrite" and family.projected_hit_rate >= family.hit_rate + 0.1
        assert family.candidates["tools-first"] >= family.hit_rate + 0.05
    # Codex's break is its working directory in the first user turn: no fix shares more.
    assert codex.fix is None and codex.projected_hit_rate == pytest.approx(codex.hit_rate)
    summary = to_json(mixed)["summary"]
    assert summary["projected_hit_rate"] >= summary["hit_rate"]
    assert summary["causes"]["per_instance_env"] == 7 and sum(summary["causes"].values()) == 7


def test_the_rewritten_log_gives_the_projection(mixed: LintResult, qwen: Tokenizer, tmp_path: Path) -> None:
    fixed = lint_log(mixed.fixed, qwen, PAGE_SIZE, PAGE_BYTES, prompt_layout="template")
    assert fixed.hit_rate == pytest.approx(mixed.projected_hit_rate)
    codex = [r for r in fixed.requests if harness_of(r.index) == "codex"]
    assert [r.brk for r in codex] == [mixed.requests[r.index].brk for r in codex]  # left as it was


def test_the_report_reads_at_80_columns(mixed: LintResult) -> None:
    out = io.StringIO()
    print_report(mixed, f"swarmkv lint {HARNESS_LOG.name}", Console(file=out, width=80))
    text = out.getvalue()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    headers = [line.split() for line in lines if line.startswith("session ")]
    assert headers == [["session", "reqs", "prompt", "cached", "hit", "breaks", "KV", "private"]] * 3
    for name in SHORT_SESSIONS["claude"]:
        row = next(line for line in lines if line.startswith(name + " "))
        assert "\u2026" not in row and len(row.split()) == 10  # nothing squeezed out: every cell whole
    assert "device_id" not in text
    for family in ("f1", "f2", "f3"):
        assert f"family {family}: " in text
    assert text.count("per_instance_env: ") == 3 and text.count("per_instance_env (hidden): ") == 4
    assert "per_instance_env: git hash b07f2d9" in text
    assert text.count("or, on the server alone: --prompt-layout tools-first: ") == 2
    assert "fix: none helps" in text


def test_the_cli_on_the_mixed_log(
    qwen: Tokenizer, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from conftest_tokenizer_helpers import smol_metadata
    from swarmkv.cli import main
    from swarmkv.config import ModelConfig
    from swarmkv.lint import model as lint_model

    model = lint_model.LintModel("qwen3", qwen, ModelConfig.from_gguf_metadata(smol_metadata()))
    monkeypatch.setattr(lint_model, "load_lint_model", lambda path: model)
    requests, problems = read_log(HARNESS_LOG, strict=True)
    assert len(requests) == 12 and not problems
    assert main(["lint", str(HARNESS_LOG), "--json", "--prompt-layout", "template"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [f["family"] for f in report["families"]] == ["f1", "f2", "f3"]
    names = {s["session"]: s["name"] for s in report["sessions"]}
    assert [n for s, n in names.items() if s.startswith("{")] == list(SHORT_SESSIONS["claude"])
    assert report["summary"]["projected_hit_rate"] >= report["summary"]["hit_rate"]
    env = [r["break"] for r in report["requests"] if r["break"] is not None]
    assert [b["cause"] for b in env] == ["per_instance_env"] * 3 and all(b["detail"] for b in env)
