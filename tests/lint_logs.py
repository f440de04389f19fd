"""Request logs for `swarmkv lint` tests: a synthetic agent swarm with switchable prefix breakers, and the
real harnesses' mixed log (lint_harnesses.jsonl).

Synthetic: N agents, each a session, take T turns in round-robin order (agent 0's turn 0, agent 1's turn
0, ...). All share one system prompt and one set of tool schemas. A turn appends the assistant's reply and
then a tool result (odd turns: the agent is in a tool loop) or a new user message (even turns). Each
breaker spoils the shared prefix the way real harnesses do.

Harnesses: Claude Code 2.1.332, Codex CLI 0.171.0 and Qwen Code 0.24.4 each ran one task (a tool round
trip: two requests) against `swarmkv serve --log-requests`; lint_make_harness_log.py trimmed those logs and
added a second instance of each, as a second run in another workspace would send it (`second_instance`).
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

CHAT_ROUTE = "/v1/chat/completions"
HARNESS_LOG = Path(__file__).with_name("lint_harnesses.jsonl")
HARNESSES = ("claude", "codex", "qwen")
# What a second run of each harness in another workspace writes differently: the workspace (and the
# paths named after it), the git repository's first commit, the session id inside Claude Code's
# `metadata.user_id` (its device id stays), and the server's tool call ids.
SECOND_INSTANCE = {
    "claude": {
        "ws-claude": "ws-claude-2",
        "572fb3a": "e81d3c0",
        "e54ea063-b364-496f-8549-29254fd22eb6": "6f1a0c2e-4b7d-4e9a-a3c5-9d2e8f7b1a60",
        "call_5422e86409eb462385565333": "call_9b1e0f7a3c2d4e5f8a6b7c9d",
    },
    "codex": {"ws-codex": "ws-codex-2", "call_5eed52d8dc7c45d79210b32e": "call_2c7d9e1f0a3b4c5d6e7f8a9b"},
    "qwen": {
        "ws-qwen": "ws-qwen-2",
        "16ab655": "b07f2d9",
        "call_0b3d553c54964fe2aa7f0bdf": "call_7e6d5c4b3a2f1e0d9c8b7a6f",
    },
}
START_TIME = 1_736_000_000.0  # 2025-01-04, unix seconds
AGENT_NAMES = ("Ada", "Grace", "Linus", "Barbara", "Edsger", "Donald", "Margaret", "Ken")

INSTRUCTIONS = (
    "You are a coding agent in a swarm that maintains one repository together.",
    "Read the relevant code before you change it, and keep each change small.",
    "Run the tests you touch before you answer, and report the last line of their output.",
    "Never invent file names, functions or command line flags; search for them first.",
    "When a tool helps, call it; when it fails, say what failed and what you tried instead.",
    "Prefer the standard library over new dependencies, and typed code over comments.",
    "Answer in English, briefly, with the diff or the command you ran.",
)
EDITED_LAST_LINE = "Answer in French, at length, with a summary of every file you read."


def _tool(name: str, description: str, **params: str) -> dict[str, Any]:
    properties = {p: {"type": "string", "description": d} for p, d in params.items()}
    schema = {"type": "object", "properties": properties, "required": list(params)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": schema}}


TOOLS = [
    _tool("read_file", "Read a file of the repository", path="path from the repository root"),
    _tool("run_tests", "Run pytest on some test files", paths="space-separated test files"),
    _tool("search_code", "Search the repository for a regular expression", pattern="a Python regex"),
    _tool("write_file", "Replace a file's content", path="path from the root", content="the new text"),
]
EXTRA_TOOL = _tool("open_browser", "Open a URL in a headless browser", url="an http(s) URL")


@dataclass(frozen=True)
class Breakers:
    """Which prefix breakers the log has (all off: a clean log)."""

    timestamp: bool = False  # "Current time: ..." at the top of every system prompt
    uuid_nonce: bool = False  # "Request id: <uuid4>" at the top of every system prompt
    tool_reorder: bool = False  # agent 1 sends the tools in reverse order
    tool_added: bool = False  # agent 1 has one more tool
    system_edit: bool = False  # agent 1's last instruction differs
    private_before_shared: bool = False  # each agent's name above the common instructions
    think: bool = False  # replies carry <think> reasoning (Qwen3's template strips it from history)


def agent_requests(
    agents: int = 4,
    turns: int = 3,
    breakers: Breakers = Breakers(),
    session_ids: bool = True,
    filler_lines: int = 0,
    reply_lines: int = 1,
    seed: int = 0,
    num_tools: int = len(TOOLS),
) -> list[dict[str, Any]]:
    """Log records in arrival order. `filler_lines` lengthens the shared system prompt, `reply_lines`
    each tool result and reply, `num_tools` the shared tools (to size prompts)."""
    rng = random.Random(seed)
    conversations = [
        [{"role": "user", "content": f"Task {a}: fix issue #{100 + a} in module_{a}.py."}]
        for a in range(agents)
    ]
    records = []
    for turn in range(turns):
        for a in range(agents):
            when = START_TIME + 7.0 * len(records)
            system = _system(a, breakers, filler_lines, when, uuid.UUID(int=rng.getrandbits(128), version=4))
            body: dict[str, Any] = {
                "messages": [{"role": "system", "content": system}, *conversations[a]],
                "tools": _tools(a, breakers, num_tools),
                "max_tokens": 1,
                "temperature": 0,
            }
            session = f"agent-{a}" if session_ids else None
            records.append({"time": when, "session_id": session, "route": CHAT_ROUTE, "body": body})
            conversations[a] = [*conversations[a], *_next_turn(a, turn, breakers, reply_lines)]
    return records


def second_instance(harness: str, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A harness's records as its second instance, in another workspace, would have sent them."""
    text = json.dumps(records, ensure_ascii=False)
    for old, new in SECOND_INSTANCE[harness].items():
        text = text.replace(old, new)
    return json.loads(text)


def harness_log() -> list[dict[str, Any]]:
    """The mixed harness log's records: instance 1 of each harness, then instance 2, each's first request,
    then each's second."""
    return [json.loads(line) for line in HARNESS_LOG.read_text(encoding="utf-8").splitlines()]


def write_log(path: Path, records: list[dict[str, Any]]) -> Path:
    """Write records as JSON lines; returns `path`."""
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def _system(agent: int, breakers: Breakers, filler_lines: int, when: float, request_id: uuid.UUID) -> str:
    lines = list(INSTRUCTIONS)
    if breakers.system_edit and agent == 1:
        lines[-1] = EDITED_LAST_LINE
    lines[-1:-1] = [
        f"Style rule {i}: keep line {i} of every module readable, typed and tested as rule {i} says."
        for i in range(filler_lines)
    ]
    if breakers.private_before_shared:
        lines.insert(
            0, f"Your name is {AGENT_NAMES[agent % len(AGENT_NAMES)]}-{agent}; sign your commits so."
        )
    if breakers.uuid_nonce:
        lines.insert(0, f"Request id: {request_id}")
    if breakers.timestamp:
        lines.insert(0, f"Current time: {datetime.fromtimestamp(when, UTC):%Y-%m-%d %H:%M:%S} UTC")
    return "\n".join(lines)


def _tools(agent: int, breakers: Breakers, num_tools: int) -> list[dict[str, Any]]:
    tools = TOOLS[:num_tools]
    if breakers.tool_reorder and agent == 1:
        tools.reverse()
    if breakers.tool_added and agent == 1:
        tools.append(EXTRA_TOOL)
    return tools


def _next_turn(agent: int, turn: int, breakers: Breakers, reply_lines: int) -> list[dict[str, Any]]:
    body = "\n".join(
        f"Step {turn}.{i} of agent {agent}: checked module_{agent}.py line {10 * i}."
        for i in range(reply_lines)
    )
    reply = f"I looked at module_{agent}.py (turn {turn}).\n{body}"
    if breakers.think:
        reply = f"<think>\nAgent {agent} considers turn {turn} carefully.\n</think>\n\n{reply}"
    if turn % 2 == 0:  # a tool call's result comes back: still in the agent's tool loop
        return [{"role": "assistant", "content": reply}, {"role": "tool", "content": f"ok {turn}\n{body}"}]
    return [{"role": "assistant", "content": reply}, {"role": "user", "content": f"Good. Next step {turn}."}]
