"""A first request the size of a real coding harness's: Qwen Code 0.24.4 opens with a 24,904-character system
prompt, 10 tool schemas (27,530 characters of JSON) and a 9,681-character reminder, about 16K tokens.

The text is seeded filler in a coding agent's vocabulary (paths, flags, identifiers, prose), sized like
those parts, so that it tokenizes about as densely as the real prompt does.
"""

from __future__ import annotations

import json
import random
from typing import Any

SYSTEM_CHARS = 24_904
TOOL_SCHEMA_CHARS = 27_530
REMINDER_CHARS = 9_681
NUM_TOOLS = 10

_WORDS = [
    "the",
    "agent",
    "reads",
    "src/engine/scheduler.py",
    "before",
    "editing;",
    "run",
    "`pytest",
    "-x",
    "-q",
    "tests/test_kv.py`",
    "and",
    "check",
    "--max-num-seqs=8",
    "--kv-cache-memory=2GiB.",
    "Never",
    "guess",
    "a",
    "path:",
    "use",
    "glob('**/*.ts')",
    "or",
    "grep",
    "-rn",
    "'def",
    "allocate'",
    "first.",
    "Prefer",
    "small",
    "diffs,",
    "keep",
    "imports",
    "sorted,",
    "explain",
    "each",
    "change",
    "in",
    "one",
    "line,",
    "e.g.",
    "fix(kv):",
    "free",
    "the",
    "partial",
    "page",
    "(#1423).",
    "Use",
    "read_file(path,",
    "offset=120,",
    "limit=80)",
    "for",
    "large",
    "files;",
    "JSON",
    "fields:",
    '{"file_path":',
    "str,",
    '"old_string":',
    "str,",
    '"new_string":',
    "str}.",
    "On",
    "error",
    "E0425",
    "or",
    "TS2339",
    "re-read",
    "the",
    "symbol,",
    "0x7f3a,",
    "v2.4.1,",
    "2026-11-30T12:34:05Z.",
]


def filler(num_chars: int, seed: int) -> str:
    """Seeded text of about `num_chars` characters."""
    rng = random.Random(seed)
    out: list[str] = []
    size = 0
    while size < num_chars:
        word = rng.choice(_WORDS)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)[:num_chars]


def tool_schemas(num_tools: int = NUM_TOOLS, total_chars: int = TOOL_SCHEMA_CHARS) -> list[dict[str, Any]]:
    """`num_tools` function tools (name, description, input schema) of about `total_chars` of JSON in all."""
    tools = []
    for i in range(num_tools):
        properties = {
            f"arg_{j}": {"type": "string", "description": filler(180, seed=1000 * i + j)} for j in range(4)
        }
        schema = {"type": "object", "properties": properties, "required": ["arg_0"]}
        tools.append({"name": f"tool_{i}", "description": "", "input_schema": schema})
    used = len(json.dumps(tools))
    for i, tool in enumerate(tools):
        tool["description"] = filler(max(0, (total_chars - used) // num_tools), seed=i)
    return tools


def harness_head() -> tuple[str, list[dict[str, Any]], str]:
    """The system prompt, the tools (Anthropic's shape) and the reminder a harness's first request opens with."""
    return filler(SYSTEM_CHARS, seed=7), tool_schemas(), filler(REMINDER_CHARS, seed=8)


def as_function_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same tools as Responses API function tools."""
    return [
        {
            "type": "function",
            "name": t["name"],
            "description": t["description"],
            "parameters": t["input_schema"],
        }
        for t in tools
    ]
