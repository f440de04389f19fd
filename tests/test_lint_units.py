"""The lint's building blocks: the prefix index against brute force, rendering against the server's path,
volatile values, the log file's round trip, and the fix's rewrites."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest_tokenizer_helpers import CORPUS
from lint_logs import Breakers, agent_requests, write_log
from swarmkv.api.chat_request import parse_chat_request
from swarmkv.breaks.patterns import volatile_at, volatile_spans
from swarmkv.lint.fix import fix_log
from swarmkv.lint.log_file import LoggedRequest, read_log
from swarmkv.lint.prefix_index import PrefixIndex
from swarmkv.lint.render import Renderer, RenderError
from swarmkv.tokenizer import Tokenizer


def brute_shared(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 60), st.lists(st.integers(0, 2), max_size=40)), min_size=1, max_size=25)
)
def test_prefix_index_matches_brute_force(recipe: list[tuple[int, list[int]]]) -> None:
    """Each prompt continues a cut of the previous ones' common stem, so prompts share prefixes of every length."""
    stem = [i % 3 for i in range(60)]
    index, prompts = PrefixIndex(), []
    for key, (cut, tail) in enumerate(recipe):
        tokens = stem[:cut] + tail
        match = index.match(tokens)
        if prompts:
            shared = [brute_shared(p, tokens) for p in prompts]
            best = max(shared)
            contained = [(len(p), k) for k, p in enumerate(prompts) if shared[k] == len(p)]
            assert match.num_tokens == best
            assert match.key == max(k for k, s in enumerate(shared) if s == best)
            assert match.extends == (max(contained)[1] if contained else None)
        else:
            assert (match.num_tokens, match.key, match.extends) == (0, None, None)
        index.add(key, tokens)
        prompts.append(tokens)


def test_rendering_matches_the_server_path(smol: Tokenizer, qwen: Tokenizer) -> None:
    """Pieces encoded apart and cached give the ids of the whole text encoded at once, as the server does."""
    records = agent_requests(3, 4, Breakers(timestamp=True, think=True))
    texts = list(CORPUS.values())
    for i, record in enumerate(records):  # every kind of text in the turns, special-token look-alikes too
        record["body"]["messages"][-1]["content"] += "\n" + texts[i % len(texts)]
    for tok in (smol, qwen):
        renderer = Renderer(tok, prompt_layout="template")  # the template's own text, below
        for i, record in enumerate(records):
            rendered = renderer.render(LoggedRequest(i, i + 1, record["route"], record["body"]))
            chat = parse_chat_request(record["body"])
            text = tok.apply_chat_template(chat.messages, tools=chat.tools)
            assert rendered.prompt.text == text
            assert rendered.prompt.token_ids == tok.encode(text, add_special_tokens=False)


def test_prompts_the_server_refuses(smol: Tokenizer) -> None:
    record = agent_requests(1, 1)[0]
    request = LoggedRequest(0, 1, record["route"], record["body"])
    assert len(Renderer(smol, max_model_len=4096).render(request).prompt.token_ids) > 100
    with pytest.raises(RenderError, match="maximum context length is 100 tokens"):
        Renderer(smol, max_model_len=100).render(request)
    no_template = LoggedRequest(1, 2, record["route"], {"messages": [], "max_tokens": 1})
    with pytest.raises(RenderError, match="non-empty array"):
        Renderer(smol).render(no_template)


def test_volatile_values() -> None:
    text = "Now: 2025-03-14T09:26:53Z, id 3f1c2a9e-8b7d-4c6f-9e1a-2b3c4d5e6f70, nonce=k3J9xQ2mP8vL1nR5."
    kinds = [(v.kind, text[v.start : v.end]) for v in volatile_spans(text)]
    assert kinds == [
        ("timestamp", "2025-03-14T09:26:53Z"),
        ("random_id", "3f1c2a9e-8b7d-4c6f-9e1a-2b3c4d5e6f70"),
        ("random_id", "nonce=k3J9xQ2mP8vL1nR5"),
    ]
    for plain in ("SmolLM2-135M-Instruct", "Market 5 times", "sha256 of the file", "version 3.11"):
        assert volatile_spans(plain) == [], plain
    assert volatile_at("Date: Mon, January 6, 2025 at 3:45 PM.", 20) is not None
    assert volatile_at("Date: today", 8) is None


def test_the_log_round_trips(tmp_path: Path) -> None:
    records = agent_requests(2, 2)
    lines = [json.dumps(r) for r in records] + [json.dumps(records[0]["body"])]
    path = tmp_path / "log.jsonl"
    path.write_text("\n".join(lines) + "\n\n")
    requests, problems = read_log(path)
    assert not problems and [r.line for r in requests] == [1, 2, 3, 4, 5]
    assert [r.to_json() for r in requests] == [*records, records[0]["body"]]
    assert (
        requests[-1].bare and requests[0].session_id == "agent-0" and requests[0].time == records[0]["time"]
    )


def test_the_fix_moves_values_and_names_and_keeps_history(tmp_path: Path) -> None:
    records = agent_requests(3, 3, Breakers(timestamp=True, private_before_shared=True, tool_reorder=True))
    requests, _ = read_log(write_log(tmp_path / "log.jsonl", records))
    fixed = [r.body for r in fix_log(requests, {r.index: r.session_id or "" for r in requests})]
    names = [t["function"]["name"] for t in fixed[4]["tools"]]
    assert names == sorted(names)
    systems = {b["messages"][0]["content"] for b in fixed}
    assert (
        len(systems) == 1
        and "Current time" not in next(iter(systems))
        and "Your name" not in next(iter(systems))
    )
    agent0 = [fixed[i]["messages"] for i in (0, 3, 6)]
    for earlier, later in zip(agent0, agent0[1:], strict=False):
        assert later[: len(earlier)] == earlier  # each turn repeats the last one's messages exactly
    # The first turn keeps its time line and ends with the agent's name, after its own shared text.
    first_turn = agent0[0][1]["content"]
    assert first_turn.startswith("Task 0:") and first_turn.endswith(
        "\n\nYour name is Ada-0; sign your commits so."
    )
    assert records[0]["body"]["messages"][0]["content"].split("\n")[0] in first_turn


def test_the_fix_moves_a_first_user_turns_context_lines_past_the_static_context(tmp_path: Path) -> None:
    # Claude Code's shape: the git status (its branch) in the first user message, then a system message with
    # the working directory and a long shared list; the per-instance lines go to the end of that first turn.
    def body(agent: int, turns: int) -> dict[str, Any]:
        context = f"# gitStatus\nCurrent branch: agent-{agent}\nMain branch: main\n\nWhat is the weather?"
        environment = f" - Primary working directory: /work/agent-{agent}\n" + "\n".join(
            f"- skill {i}: does {i}" for i in range(20)
        )
        messages = [
            {"role": "system", "content": "You are an agent.\nBe brief."},
            {"role": "user", "content": context},
            {"role": "system", "content": environment},
        ]
        reply = [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks."}]
        return {"messages": messages + reply * turns}

    records = [
        {"session_id": f"agent-{a}", "route": "/v1/chat/completions", "body": body(a, t)}
        for t in range(2)
        for a in range(3)
    ]
    requests, _ = read_log(write_log(tmp_path / "log.jsonl", records))
    fixed = [r.body["messages"] for r in fix_log(requests, {r.index: r.session_id or "" for r in requests})]
    # Every agent's first turn is the same up to its own lines, which end it.
    assert fixed[0][1] == fixed[1][1] and "agent-" not in fixed[0][1]["content"]
    assert fixed[0][2]["content"].endswith(
        "\n\nCurrent branch: agent-0\n - Primary working directory: /work/agent-0"
    )
    assert fixed[0][2]["content"].startswith("- skill 0: does 0")
    assert fixed[3][:3] == fixed[0]  # a later turn repeats the first exactly


def test_a_messages_request_renders_in_the_layout_the_server_gave_it(qwen: Tokenizer, tmp_path: Path) -> None:
    # The server logs a Messages request as its chat body, with "api": "messages", and lint renders each
    # request in the layout its API got: under --prompt-layout auto, tools-first on every API.
    tool = {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}
    body = {
        "messages": [{"role": "system", "content": "You are in /home/a."}, {"role": "user", "content": "hi"}]
    }
    body["tools"] = [tool]
    path = tmp_path / "log.jsonl"
    lines = [{"route": "/v1/chat/completions", "body": body}, {"route": "/v1/chat/completions", "body": body}]
    lines[1]["api"] = "messages"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    chat, messages = read_log(path)[0]
    assert (chat.api, messages.api) == ("chat", "messages")
    assert messages.to_json()["api"] == "messages" and "api" not in chat.to_json()
    renderer = Renderer(qwen, prompt_layout="auto")
    as_chat, as_messages = renderer.render(chat).prompt, renderer.render(messages).prompt
    assert as_messages.text.index("# Tools") < as_messages.text.index("You are in")
    assert as_chat.text == as_messages.text
    templated = Renderer(qwen, prompt_layout="template").render(messages).prompt.text
    assert templated.index("# Tools") > templated.index("You are in")


def test_tenants_in_a_log_share_no_salt_or_session(smol: Tokenizer, tmp_path: Path) -> None:
    # Under --api-keys the server logs each request's tenant, and scopes its salt and session by it.
    body = {"messages": [{"role": "user", "content": "hi"}], "session_id": "agent-1"}
    lines = [
        {"route": "/v1/chat/completions", "session_id": "agent-1", "body": body, "tenant": t} for t in "ab"
    ]
    lines.append({"route": "/v1/chat/completions", "session_id": "agent-1", "body": body})
    path = tmp_path / "log.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    requests = read_log(path)[0]
    assert [r.tenant for r in requests] == ["a", "b", None]
    assert requests[0].to_json()["tenant"] == "a" and "tenant" not in requests[2].to_json()
    renderer = Renderer(smol)
    rendered = [renderer.render(r) for r in requests]
    assert len({r.cache_salt for r in rendered}) == 3  # "a", "b" and no salt
    assert len({r.session_id for r in rendered}) == 3
    assert rendered[0].prompt.token_ids == rendered[1].prompt.token_ids


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"api": "grpc"}, "'api' must be one of chat, messages, responses"),
        ({"tenant": 7}, "'tenant' must be"),
    ],
)
def test_a_log_line_with_a_bad_api_or_tenant_is_reported(
    tmp_path: Path, extra: dict[str, Any], message: str
) -> None:
    line = {
        "route": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "hi"}]},
        **extra,
    }
    path = tmp_path / "log.jsonl"
    path.write_text(json.dumps(line) + "\n", encoding="utf-8")
    requests, problems = read_log(path)
    assert requests == [] and len(problems) == 1 and message in problems[0].message
