"""Families of requests: one harness, one system prompt. The lint compares a request only with its family's.

A log can hold several harnesses (Claude Code, Codex, Qwen Code) and one harness's side requests (a
sub-agent, a title writer), each with its own system prompt; comparing one with another finds nothing a fix
could share. A request's family follows from what the log holds: its route, and its head (the system
messages' lines, with every per-instance value, date, time and id masked, and its tools' names), which must
share at least half the text of the larger of its head and the family's first request's (an agent with one
more tool or an edited line stays in its family; a sub-agent's shorter prompt made of some of the main
prompt's lines does not). Chat requests without system messages are one family, and so are completions
(a raw prompt has no head to tell harnesses apart by).
"""

from __future__ import annotations

import json
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from swarmkv.lint.hidden import ValueScanner
from swarmkv.lint.render import RenderedRequest

MIN_SHARED = 0.5  # of the larger head's characters, for two requests to be one family
DESCRIPTION_CHARS = 44
_OPENING_LINES = 12  # where a "You are ..." line names the harness


@dataclass(frozen=True)
class Family:
    """A family of requests: its name (`f1`, ... in order of first request) and what it is."""

    name: str
    route: str
    description: str  # the system prompt's opening words, or what stands for them
    num_tools: int


@dataclass(frozen=True)
class _Head:
    lines: dict[str, int]  # masked line -> characters (a tool's name counts as a line)
    weight: int


class Families:
    """Feeds rendered requests in log order; `assign` returns each one's family."""

    def __init__(self) -> None:
        self.families: list[Family] = []
        self._heads: list[_Head] = []  # each family's first request's
        self._known: dict[Hashable, Family] = {}
        self._scanner = ValueScanner()

    def assign(self, request: RenderedRequest) -> Family:
        """The request's family: the most similar of its route's, else a new one."""
        route = request.request.route
        system, tools = _head_parts(request)
        key = (route, json.dumps([system, tools], ensure_ascii=False))
        known = self._known.get(key)
        if known is not None:
            return known
        head = self._head(system, tools)
        best: tuple[float, int] | None = None
        for number, (family, first) in enumerate(zip(self.families, self._heads, strict=True)):
            if family.route != route:
                continue
            score = _shared(head, first)
            if score >= MIN_SHARED and (best is None or score > best[0]):
                best = (score, number)
        if best is None:
            family = Family(f"f{len(self.families) + 1}", route, _describe(system, request), len(tools))
            self.families.append(family)
            self._heads.append(head)
        else:
            family = self.families[best[1]]
        self._known[key] = family
        return family

    def _head(self, system: list[str], tools: list[str]) -> _Head:
        lines: dict[str, int] = {}
        for text in system:
            for line in self._masked(text).split("\n"):
                if line.strip():
                    lines[line.strip()] = len(line.strip())
        for name in tools:
            lines[f"\u0000tool {name}"] = len(name)
        return _Head(lines, sum(lines.values()))

    def _masked(self, text: str) -> str:
        pieces, at = [], 0
        for value in self._scanner.spans(text):
            pieces += [text[at : value.start], f"<{value.kind}>"]
            at = value.end
        pieces.append(text[at:])
        return "".join(pieces)


def _shared(a: _Head, b: _Head) -> float:
    """The characters two heads share, as a fraction of the larger head's (1 for two empty heads)."""
    larger = max(a.weight, b.weight)
    if larger == 0:
        return 1.0
    shared = sum(n for line, n in a.lines.items() if line in b.lines)
    return shared / larger


def _head_parts(request: RenderedRequest) -> tuple[list[str], list[str]]:
    """The system texts and tool names the head is rendered from (none for a completion)."""
    prompt = request.prompt
    if not prompt.messages:
        return [], []
    system = []
    for message in prompt.messages:
        if message.get("role") != "system":
            break
        system.append(_text(message.get("content")))
    return system, [_tool_name(tool) for tool in prompt.tools or []]


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _tool_name(tool: dict[str, Any]) -> str:
    function = tool.get("function")
    name = function.get("name") if isinstance(function, dict) else tool.get("name")
    return name if isinstance(name, str) else json.dumps(tool, sort_keys=True)[:80]


def _describe(system: list[str], request: RenderedRequest) -> str:
    """The system prompt's opening words: its `You are ...` line if it opens with one, else its first line."""
    if not request.prompt.messages:
        return "(completions)"
    lines = [line.strip() for text in system for line in text.split("\n") if line.strip()]
    if not lines:
        return "(no system prompt)"
    opening = next((line for line in lines[:_OPENING_LINES] if line.startswith("You are")), lines[0])
    return _words(opening, DESCRIPTION_CHARS)


def _words(text: str, limit: int) -> str:
    """`text` within `limit` characters, cut at a word break (an ellipsis marks the cut)."""
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit)
    return (text[:cut] if cut > limit // 2 else text[: limit - 1]).rstrip(",;:") + "\u2026"
