"""Each prefix breaker of the generated agent logs is found on the right requests, with the right cause, at
the offset computed here independently (the template's text, encoded whole, against every earlier prompt)."""

from __future__ import annotations

from typing import Any

import pytest

from lint_logs import Breakers, agent_requests
from swarmkv.lint.log_file import LoggedRequest
from swarmkv.lint.run import LintResult, lint_log
from swarmkv.tokenizer import Tokenizer

AGENTS, TURNS = 4, 3
PAGE_SIZE, PAGE_BYTES = 16, 1024


def logged(records: list[dict[str, Any]]) -> list[LoggedRequest]:
    return [
        LoggedRequest(i, i + 1, r["route"], r["body"], r["session_id"], r["time"])
        for i, r in enumerate(records)
    ]


def encoded(tok: Tokenizer, body: dict[str, Any]) -> list[int]:
    text = tok.apply_chat_template(body["messages"], tools=body.get("tools"))
    return tok.encode(text, add_special_tokens=False)


def shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_offset(prompts: list[list[int]], i: int) -> int:
    """Tokens request i shares with the earlier prompt it shares the most with."""
    return max(shared(prompts[j], prompts[i]) for j in range(i))


def lint(tok: Tokenizer, records: list[dict[str, Any]]) -> LintResult:
    # In the template's order, as `encoded` renders the prompts the offsets are checked against.
    return lint_log(logged(records), tok, PAGE_SIZE, PAGE_BYTES, check=True, prompt_layout="template")


def check_breaks(tok: Tokenizer, records: list[dict[str, Any]], expected: dict[int, str]) -> LintResult:
    result = lint(tok, records)
    prompts = [encoded(tok, r["body"]) for r in records]
    found = {r.index: r.brk for r in result.requests if r.brk is not None}
    assert {i: b.cause for i, b in found.items()} == expected
    for i, brk in found.items():
        assert brk.offset == expected_offset(prompts, i), (i, brk)
        assert result.requests[i].prompt_tokens == len(prompts[i])
    return result


def test_a_clean_log_has_no_breaks(smol: Tokenizer) -> None:
    result = check_breaks(smol, agent_requests(AGENTS, TURNS), {})
    assert result.hit_rate > 0.7
    assert result.projected_hit_rate == result.hit_rate
    assert [s.session for s in result.sessions] == [f"agent-{a}" for a in range(AGENTS)]


@pytest.mark.parametrize(
    ("breakers", "cause"),
    [(Breakers(timestamp=True), "timestamp"), (Breakers(uuid_nonce=True), "random_id")],
)
def test_a_volatile_value_on_top_breaks_every_request(
    smol: Tokenizer, breakers: Breakers, cause: str
) -> None:
    records = agent_requests(AGENTS, TURNS, breakers)
    result = check_breaks(smol, records, {i: cause for i in range(1, AGENTS * TURNS)})
    assert all(not r.hidden for r in result.requests)
    assert result.projected_hit_rate > result.hit_rate + 0.5


@pytest.mark.parametrize(
    ("breakers", "cause"),
    [
        (Breakers(tool_reorder=True), "tool_order"),
        (Breakers(tool_added=True), "tool_set"),
        (Breakers(system_edit=True), "system_edit"),
    ],
)
def test_one_odd_agent_breaks_once(smol: Tokenizer, breakers: Breakers, cause: str) -> None:
    # Agent 1's first request parts from agent 0's in the head; its later turns continue its own.
    check_breaks(smol, agent_requests(AGENTS, TURNS, breakers), {1: cause})


def test_agent_names_above_the_shared_instructions(smol: Tokenizer) -> None:
    records = agent_requests(AGENTS, TURNS, Breakers(private_before_shared=True))
    result = check_breaks(smol, records, {a: "private_before_shared" for a in range(1, AGENTS)})
    assert result.projected_hit_rate > result.hit_rate


def test_reasoning_stripped_from_history_by_the_template(qwen: Tokenizer) -> None:
    # A new user message makes Qwen3's template drop the reasoning of the turns before it: even turns >= 2.
    records = agent_requests(AGENTS, 5, Breakers(think=True))
    expected = {t * AGENTS + a: "history_rewrite" for t in (2, 4) for a in range(AGENTS)}
    result = check_breaks(qwen, records, expected)
    assert result.projected_hit_rate > result.hit_rate


def test_without_session_ids_sessions_follow_the_conversation(smol: Tokenizer) -> None:
    records = agent_requests(AGENTS, TURNS, Breakers(timestamp=True), session_ids=False)
    result = check_breaks(smol, records, {i: "timestamp" for i in range(1, AGENTS * TURNS)})
    sessions = [r.session for r in result.requests]
    assert sessions == [f"auto-{a + 1}" for a in range(AGENTS)] * TURNS


def test_the_classic_breakers_and_the_fix(smol: Tokenizer) -> None:
    """A timestamp on top of every system prompt hides agent 1's reordered tools: both are found, and the
    fix lifts the hit rate by more than 0.2."""
    records = agent_requests(AGENTS, TURNS, Breakers(timestamp=True, tool_reorder=True))
    result = check_breaks(smol, records, {i: "timestamp" for i in range(1, AGENTS * TURNS)})
    hidden = {r.index: r.hidden for r in result.requests if r.hidden}
    assert list(hidden) == [1] and [b.cause for b in hidden[1]] == ["tool_order"]
    # Independently: agent 0's first request with agent 1's time line, against agent 1's.
    first, second = records[0]["body"], records[1]["body"]
    time_line = second["messages"][0]["content"].split("\n")[0]
    lines = first["messages"][0]["content"].split("\n")
    aligned_messages = [
        {"role": "system", "content": "\n".join([time_line, *lines[1:]])},
        *first["messages"][1:],
    ]
    aligned = encoded(smol, {**first, "messages": aligned_messages})
    assert hidden[1][0].offset == shared(aligned, encoded(smol, second))
    assert result.causes["timestamp"] == AGENTS * TURNS - 1 and result.causes["tool_order"] == 1
    assert result.projected_hit_rate >= result.hit_rate + 0.2
    assert result.projected_kv_bytes < result.kv_bytes
    # The rewritten log lints clean.
    fixed = lint_log(result.fixed, smol, PAGE_SIZE, PAGE_BYTES)
    assert all(r.brk is None and not r.hidden for r in fixed.requests)
    assert fixed.hit_rate == pytest.approx(result.projected_hit_rate)
