"""Per-instance environment text, the evidence cut at word breaks, short session names, and the
projection's guarantee: a fix is kept only where it leaves no family, and not the log, below today."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from lint_logs import Breakers, agent_requests
from swarmkv.breaks.causes import MAX_EVIDENCE_CHARS, RenderedPrompt, classify, divergence
from swarmkv.breaks.environment import env_at, line_values, shorten
from swarmkv.lint import run as lint_run
from swarmkv.lint.log_file import LoggedRequest
from swarmkv.lint.names import short_name, short_names
from swarmkv.lint.replay import ReplayRequest, ReplayResult
from swarmkv.lint.run import lint_log
from swarmkv.tokenizer import Tokenizer


def values(line: str, above: str = "") -> list[tuple[str, str, bool]]:
    return [(v.what, line[v.start : v.end], v.cued) for v in line_values(line, above)]


def test_environment_values_on_the_harnesses_lines() -> None:
    assert values(" - Primary working directory: /tmp/ws-a") == [("working directory", "/tmp/ws-a", True)]
    assert values("  <cwd>/home/ada/work</cwd>") == [("working directory", "/home/ada/work", True)]
    assert values("I'm currently working in the directory: /srv/x.") == [
        ("working directory", "/srv/x", True)
    ]
    memory = "memory system at `/root/.claude/projects/-tmp-ws-a/memory/`. It exists."
    assert values(memory) == [("path", "/root/.claude/projects/-tmp-ws-a/memory/", False)]
    assert values("git: 16ab655 init") == [("git hash", "16ab655", True)]
    assert values("572fb3a init", above="Recent commits:\n9c41e07 fix\n0d2b6a1 add") == []  # cue too far up
    assert values("572fb3a init", above="(clean)\nRecent commits:") == [("git hash", "572fb3a", True)]
    assert values("ada@devbox:~$ ls") == [("user name", "ada", True), ("host name", "devbox", True)]
    assert values("User: ada") == [("user name", "ada", True)]
    assert values("<hostname>build-7</hostname>") == [("host name", "build-7", True)]
    assert values(r"cwd: C:\Users\ada\src") == [("working directory", r"C:\Users\ada\src", True)]
    # Claude Code's git status: each worktree of a project is on a branch of its own.
    assert values("Current branch: agent-1") == [("git branch", "agent-1", True)]
    assert values("On branch feature/x-2") == [("git branch", "feature/x-2", True)]
    for plain in (
        "user: I'm a data scientist",  # prose after `user:`, as in Claude Code's memory examples
        "user: stop summarizing what you just did",
        "Co-Authored-By: Claude <noreply@anthropic.com>",
        "  - /help: Get help with using Claude Code",
        "see https://example.com/a/b and/or the docs",
        "version 16ab655 of the file",  # hex, but no git on the line
        "Main branch (you will usually use this for PRs): main",  # the project's, the same in every worktree
        "We branch out to many cities",
    ):
        assert values(plain) == [], plain


def test_env_at_finds_the_value_around_a_position() -> None:
    text = "Recent commits:\n572fb3a init\n - Primary working directory: /tmp/ws-b\n"
    commit = env_at(text, text.index("572fb3a") + 3)
    assert commit is not None and (commit.what, text[commit.start : commit.end]) == ("git hash", "572fb3a")
    cwd = env_at(text, text.index("ws-b"))
    assert cwd is not None and text[cwd.start : cwd.end] == "/tmp/ws-b"
    assert env_at(text, text.index("init")) is None and env_at(text, len(text)) is None


def test_long_paths_keep_their_ends() -> None:
    path = "/tmp/harness-research/home-claude/.claude/projects/-tmp-harness-research-ws-claude-2/memory/"
    short = shorten(path)
    assert short == "/tmp/\u2026/-tmp-harness-research-ws-claude-2/memory/" and len(short) <= 56
    assert shorten("/tmp/ws-a") == "/tmp/ws-a"


def render(tok: Tokenizer, system: str, user: str = "hi") -> RenderedPrompt:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    text = tok.apply_chat_template(messages)
    return RenderedPrompt(tok.encode(text), text, messages, None)


RULES = "\n".join(f"Rule {i}: keep the change small, typed and tested, as rule {i} says." for i in range(6))


def test_a_date_is_the_instance_s_in_a_first_request_and_a_clock_within_a_session(smol: Tokenizer) -> None:
    a = render(smol, f"{RULES}\nToday's date is 2026-12-01.\n{RULES}")
    b = render(smol, f"{RULES}\nToday's date is 2026-12-02.\n{RULES}")
    offset = divergence(a.token_ids, b.token_ids)
    first = classify(a, b, offset, smol, first_request=True)
    assert (first.cause, first.detail) == ("per_instance_env", "date 2026-12-02")
    assert classify(a, b, offset, smol).cause == "timestamp"


def test_the_same_path_break_is_named_alike_wherever_it_stands(smol: Tokenizer) -> None:
    """A working directory at the top of the system prompt, or below the shared lines: one name (the
    classifier once said private_before_shared for one and system_edit for the other)."""
    for system in ("Working directory: {}\n" + RULES, RULES + "\nWorking directory: {}"):
        a, b = render(smol, system.format("/tmp/ws-a")), render(smol, system.format("/tmp/ws-b"))
        found = classify(a, b, divergence(a.token_ids, b.token_ids), smol, first_request=True)
        assert (found.cause, found.detail) == ("per_instance_env", "working directory /tmp/ws-b")
        assert found.text.startswith("/tmp/ws-b") or found.text.startswith("ws-b")


def test_evidence_is_cut_at_word_breaks(smol: Tokenizer) -> None:
    words = " ".join(f"word{i}" for i in range(40))
    a, b = (
        render(smol, f"{RULES}\nAnswer in English, {words}"),
        render(smol, f"{RULES}\nAnswer in French, {words}"),
    )
    found = classify(a, b, divergence(a.token_ids, b.token_ids), smol)
    assert found.text.startswith("French, word0") and len(found.text) <= MAX_EVIDENCE_CHARS
    assert b.text[b.text.index(found.text) + len(found.text)] == " "


def test_short_session_names() -> None:
    user_id = (
        '{"device_id":"048d743ec39bd09995b71da63e72bef521252ac674738e3f3e567f03b53888ce",'
        '"account_uuid":"","session_id":"e54ea063-b364-496f-8549-29254fd22eb6"}'
    )
    assert short_name(user_id) == "e54ea063"
    assert short_name("e54ea063-b364-496f-8549-29254fd22eb6") == "e54ea063"
    assert short_name("agent-1") == "agent-1" and short_name("user:agent-1") == "user:agent-1"
    long = "a-session-name-far-too-long-for-a-table"
    assert len(short_name(long)) == 12 and short_name(long) == short_name(long)
    assert short_name(long).startswith("a-sessi") and short_name("user:" + long).startswith("user:")
    twins = ["e54ea063-0000-4000-8000-000000000001", "e54ea063-0000-4000-8000-000000000002"]
    names = short_names(twins)
    assert len(set(names.values())) == 2 and all(len(n) <= 12 for n in names.values())


def logged(records: list[dict[str, Any]]) -> list[LoggedRequest]:
    return [
        LoggedRequest(i, i + 1, r["route"], r["body"], r["session_id"], r["time"])
        for i, r in enumerate(records)
    ]


def two_families() -> list[dict[str, Any]]:
    """Family A: agents with a timestamp on top (the rewrite helps); family B: other agents with another
    system prompt and no breaks."""
    a = agent_requests(2, 3, Breakers(timestamp=True))
    b = agent_requests(2, 3, seed=1)
    for record in b:
        record["session_id"] = "b-" + record["session_id"]
        record["body"]["messages"][0]["content"] = "You review patches.\n" + "\n".join(
            f"Review rule {i}: read the whole diff, then the tests, then say what is missing."
            for i in range(8)
        )
    return [*a, *b]


def test_a_fix_that_lowers_another_family_is_dropped(
    smol: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The families share one KV pool, so a fix for one could cost another its hits: then no fix is kept,
    and the projection is today's."""
    records = two_families()
    honest = lint_log(logged(records), smol, 16, 1024)
    family_a, family_b = honest.families
    assert family_a.fix == "rewrite" and family_a.projected_hit_rate > family_a.hit_rate + 0.3
    assert family_b.fix is None and honest.projected_hit_rate > honest.hit_rate
    real_replay = lint_run.replay
    today: list[list[int]] = []

    def spiteful(requests: Sequence[ReplayRequest], *args: Any, **kwargs: Any) -> ReplayResult:
        """The real replay, but any change to the log costs family B all its hits."""
        result = real_replay(requests, *args, **kwargs)
        tokens = [r.token_ids for r in requests]
        if not today:
            today.extend(tokens)
        if tokens == today:
            return result
        cached = [
            0 if r.group.startswith("b-") else c for r, c in zip(requests, result.cached_tokens, strict=True)
        ]
        return ReplayResult(
            cached,
            *[getattr(result, f) for f in ("kv_bytes", "peak_kv_bytes", "page_bytes")],
            result.group_kv_bytes,
            result.group_private_kv_bytes,
        )

    monkeypatch.setattr(lint_run, "replay", spiteful)
    result = lint_log(logged(records), smol, 16, 1024)
    assert result.families[0].candidates["rewrite"] > result.families[0].hit_rate + 0.3  # it would help A
    assert [f.fix for f in result.families] == [None, None]
    assert result.projected_hit_rate == result.hit_rate
    assert all(f.projected_hit_rate == f.hit_rate for f in result.families)
    assert result.fixed == logged(records)  # the --fix log is the log: nothing to change
