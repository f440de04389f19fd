"""Rewrite a log's requests so their prompts share a stable head and keep their history byte-identical.

- timestamp, random_id: system-prompt lines holding a date, time or id that varies between requests
  move to a trailing line of the last message, and that message keeps them in the session's later
  requests (as a harness that stamps each new message once would), so the history never changes.
- tool_order, tool_set: tools sorted by name (every agent then lists a shared tool at the same place).
- private_before_shared, per_instance_env: lines only some agents have (a name, a working directory, a git
  branch), in a message of the first turn with lines most agents share, move to the end of the first turn
  (the messages before the first reply: the system prompt, the context a harness puts in the first user
  message, such as Claude Code's git status, and any system message after it), after the whole shared head
  and the turn's own shared text (both stay the same every turn).
- history_rewrite (when the lint found it): reasoning (`<think>...</think>`, `reasoning_content`) dropped
  from earlier assistant turns, as templates that strip it render them later anyway.

The first three change nothing in a log without such lines or with sorted tools. Lines count as shared
among the requests given: give one family's (one harness, one system prompt) at a time, or every line of
one harness's prompt is private next to another harness's.
"""

from __future__ import annotations

import copy
import json
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from swarmkv.breaks.patterns import volatile_spans
from swarmkv.lint.log_file import LoggedRequest

_SYSTEM_ROLES = ("system", "developer")
_REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")

# A session's stamped messages: (position, the message as logged) -> the lines appended to it.
Stamps = dict[tuple[int, str], str]


def fix_log(
    requests: list[LoggedRequest], session_of: dict[int, str], strip_reasoning: bool = False
) -> list[LoggedRequest]:
    """The requests rewritten; `session_of` maps request index to session (requests without one, such as
    those that did not render, are left as they are)."""
    chat = [r for r in requests if r.is_chat and r.index in session_of and _messages(r.body)]
    counts: Counter[str] = Counter()
    holders: dict[str, set[str]] = defaultdict(set)
    for request in chat:
        counts.update(set(_system_lines(_messages(request.body))))
        for line in _lines(_first_turn(_messages(request.body))):
            holders[line].add(session_of[request.index])
    num_sessions = len({session_of[r.index] for r in chat})

    varying = {line for line, n in counts.items() if n < len(chat) and volatile_spans(line)}

    def varies(line: str) -> bool:
        """A line with a date, time or id that not every request has."""
        return line in varying

    def shared(line: str) -> bool:
        """A line at least two sessions and half of them have."""
        return len(holders[line]) >= max(2, (num_sessions + 1) // 2)

    stamps: dict[str, Stamps] = defaultdict(dict)
    fixed = {}
    for request in chat:
        body = copy.deepcopy(request.body)
        messages = body["messages"]
        _move_to_tail(messages, varies, stamps[session_of[request.index]])
        if isinstance(body.get("tools"), list):
            body["tools"] = sorted(body["tools"], key=_tool_name)
        _move_private(messages, shared)
        if strip_reasoning:
            _drop_reasoning(messages)
        fixed[request.index] = request.with_body(body)
    return [fixed.get(r.index, r) for r in requests]


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    return [m for m in messages if isinstance(m, dict)] if isinstance(messages, list) else []


def _leading_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    head = []
    for message in messages:
        if message.get("role") not in _SYSTEM_ROLES:
            break
        head.append(message)
    return head


def _first_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages before the first reply."""
    turn = []
    for message in messages:
        if message.get("role") == "assistant":
            break
        turn.append(message)
    return turn


def _system_lines(messages: list[dict[str, Any]]) -> list[str]:
    return _lines(_leading_system(messages))


def _lines(messages: list[dict[str, Any]]) -> list[str]:
    return [
        line
        for m in messages
        if isinstance(m.get("content"), str)
        for line in m["content"].split("\n")
        if line.strip()
    ]


def _move_to_tail(messages: list[dict[str, Any]], varies: Callable[[str], bool], stamps: Stamps) -> None:
    """Move varying volatile lines of the system messages to the end of the last message; messages the
    session stamped before get their own lines again."""
    moved: list[str] = []
    for message in _leading_system(messages):
        if isinstance(message.get("content"), str):
            lines = message["content"].split("\n")
            moved += [line for line in lines if varies(line)]
            message["content"] = "\n".join(line for line in lines if not varies(line)).strip("\n")
    keys = [(i, json.dumps(m, sort_keys=True)) for i, m in enumerate(messages)]
    last = messages[-1]
    stampable = isinstance(last.get("content"), str) and last.get("role") not in _SYSTEM_ROLES
    if moved and stampable and keys[-1] not in stamps:
        stamps[keys[-1]] = "\n\n" + "\n".join(moved)
    for key, message in zip(keys, messages, strict=True):
        if key in stamps:
            message["content"] = message["content"] + stamps[key]


def _move_private(messages: list[dict[str, Any]], shared: Callable[[str], bool]) -> None:
    """Move the private lines of the first turn's messages (those that hold shared ones: a message all private
    is one agent's own, nothing to share) to the end of the first turn, when a system prompt leads it."""
    head, turn = _leading_system(messages), _first_turn(messages)
    if not head or len(head) == len(turn) or not isinstance(turn[-1].get("content"), str | list):
        return
    moved: list[str] = []
    for message in turn:
        if not isinstance(message.get("content"), str):
            continue
        lines = message["content"].split("\n")
        if not any(line.strip() and shared(line) for line in lines):
            continue
        private = [i for i, line in enumerate(lines) if line.strip() and not shared(line)]
        moved += [lines[i] for i in private]
        message["content"] = "\n".join(line for i, line in enumerate(lines) if i not in private).strip("\n")
    if not moved:
        return
    text = "\n".join(moved)
    content = turn[-1]["content"]
    if isinstance(content, str):
        turn[-1]["content"] = content + "\n\n" + text
    else:
        turn[-1]["content"] = [*content, {"type": "text", "text": text}]


def _drop_reasoning(messages: list[dict[str, Any]]) -> None:
    """Drop the reasoning of every assistant turn but a final one."""
    for message in messages[:-1]:
        if message.get("role") != "assistant":
            continue
        for key in _REASONING_KEYS:
            message.pop(key, None)
        content = message.get("content")
        if isinstance(content, str) and "</think>" in content:
            message["content"] = content.split("</think>")[-1].lstrip("\n")


def _tool_name(tool: Any) -> str:
    function = tool.get("function") if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else ""
