"""Make tests/lint_harnesses.jsonl, the lint's mixed harness log, from real `swarmkv serve --log-requests` logs.

Run by hand (never by a test): `python tests/lint_make_harness_log.py /tmp/harness-research OUT.jsonl
[--full]`. It reads the two requests (a tool round trip) that Claude Code 2.1.332, Codex CLI 0.171.0 and
Qwen Code 0.24.4 each sent in one run (requests-claude-sonnet46.jsonl, requests-codex.jsonl,
requests-qwen.jsonl), trims them (`--full` keeps them whole): long prompts keep their opening and closing
lines, their headings, every line holding a path, a date, a git status and every sixth line else, each cut to
160 characters, and four of each harness's tools, with shorter descriptions; then adds each harness's second
instance (`lint_logs.second_instance`: another workspace, git hash, session and tool call ids) and writes
the log in the order the instances ran: the first request of each instance, then their second.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from lint_logs import HARNESSES, second_instance

KEEP_TOOLS = {
    "claude": ("Bash", "Read", "Edit", "Write"),
    "codex": ("exec_command", "write_stdin", "view_image", "get_goal"),
    "qwen": ("read_file", "run_shell_command", "edit", "write_file"),
}
LOGS = {
    "claude": "requests-claude-sonnet46.jsonl",
    "codex": "requests-codex.jsonl",
    "qwen": "requests-qwen.jsonl",
}
LINE_CHARS, TOOL_CHARS, PARAM_CHARS = 160, 300, 100
_EVERY = 6
_ENV_WORDS = ("/tmp/", "date", "directory", "branch", "commit", "git:", "cwd", "root>")


def main() -> None:
    """Write the mixed log."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("research", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--full", action="store_true", help="keep the requests whole")
    args = parser.parse_args()
    first: list[list[dict[str, Any]]] = []
    for harness in HARNESSES:
        lines = (args.research / LOGS[harness]).read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines]
        if not args.full:
            records = [_trimmed(harness, r) for r in records]
        first.append(records)
    second = [second_instance(harness, records) for harness, records in zip(HARNESSES, first, strict=True)]
    order = [runs[turn] for turn in range(2) for runs in (*first, *second)]
    for i, record in enumerate(order):
        record["time"] = round(order[0]["time"] + 10.0 * i, 3)
    args.out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in order), encoding="utf-8")


def _trimmed(harness: str, record: dict[str, Any]) -> dict[str, Any]:
    body = dict(record["body"])
    body["messages"] = [_trimmed_message(m) for m in body["messages"]]
    body["tools"] = [_trimmed_tool(t) for t in body["tools"] if t["function"]["name"] in KEEP_TOOLS[harness]]
    return {**record, "body": body}


def _trimmed_message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if isinstance(content, str):
        return {**message, "content": _trimmed_text(content)}
    if isinstance(content, list):
        parts = [{**p, "text": _trimmed_text(p["text"])} if p.get("type") == "text" else p for p in content]
        return {**message, "content": parts}
    return message


def _trimmed_text(text: str) -> str:
    lines = text.split("\n")
    if len(lines) < 12:
        return "\n".join(_cut(line) for line in lines)
    kept = []
    for i, line in enumerate(lines):
        if i < 6 or i >= len(lines) - 4 or line.startswith(("#", "<", "git", "- `")) or i % _EVERY == 0:
            kept.append(_cut(line))
        elif any(word in line for word in _ENV_WORDS) or _is_commit(line):
            kept.append(line if "/tmp/" in line else _cut(line))
    return "\n".join(kept)


def _is_commit(line: str) -> bool:
    word = line.split(" ")[0]
    return len(word) == 7 and all(c in "0123456789abcdef" for c in word)


def _cut(line: str, limit: int = LINE_CHARS) -> str:
    if len(line) <= limit or "/tmp/" in line:
        return line
    cut = line.rfind(" ", 0, limit)
    return line[: cut if cut > 0 else limit]


def _trimmed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = dict(tool["function"])
    if isinstance(function.get("description"), str):
        function["description"] = _cut(function["description"], TOOL_CHARS)
    function["parameters"] = _short_descriptions(function.get("parameters", {}))
    return {**tool, "function": function}


def _short_descriptions(schema: Any) -> Any:
    if isinstance(schema, dict):
        return {
            k: _cut(v, PARAM_CHARS) if k == "description" and isinstance(v, str) else _short_descriptions(v)
            for k, v in schema.items()
        }
    if isinstance(schema, list):
        return [_short_descriptions(v) for v in schema]
    return schema


if __name__ == "__main__":
    main()
