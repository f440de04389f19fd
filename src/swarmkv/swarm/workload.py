"""A deterministic coding-agent swarm: one shared system prompt and tool set, a private task per agent."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from swarmkv.swarm.tools import CODING_TOOLS
from swarmkv.tokenizer import Tokenizer

Message = dict[str, Any]

_ROLE = (
    "You are a coding agent working inside a software repository. You complete the task you are given "
    "by reading code, running commands and editing files through the tools provided. You work carefully "
    "and you verify what you change."
)
# Harness rules, in the order a real system prompt grows: each one is static, so all agents share it.
_RULES = (
    "Read the relevant files before you change them; never guess at code you have not seen.",
    "Keep changes minimal and focused on the task. Do not reformat unrelated code or rename things that the task does not mention.",
    "After every change, run the narrowest test that covers it, then the wider suite before you finish.",
    "Prefer edit_file over write_file for existing files so that unrelated lines stay untouched.",
    "When a command fails, read its full output and fix the cause rather than retrying blindly.",
    "Never commit secrets, credentials or large generated files. Leave the git history to the user.",
    "Follow the conventions you observe in the surrounding code: naming, error handling, logging and test layout.",
    "If a test fails for a reason unrelated to your change, report it instead of changing the test.",
    "Write docstrings for new public functions and keep comments about why, not what.",
    "Use search_code to find every caller before you change a function's signature.",
    "Do not install new dependencies unless the task asks for it; say so when a dependency would help.",
    "Keep each tool call small: read files in pages, limit search results, and avoid commands with huge output.",
    "When the task is done, reply with a short summary of what you changed, which tests you ran and their result.",
    "If the task is ambiguous, choose the most conservative reading and state the assumption in your summary.",
    "Handle errors explicitly: validate inputs at the boundary and raise typed errors with actionable messages.",
    "Respect the project's supported Python versions and avoid syntax newer than its minimum version.",
    "Do not leave debugging output, commented-out code or TODO markers behind.",
    "For performance work, measure before and after with the project's benchmark scripts and report both numbers.",
    "Treat files under vendor/, third_party/ and generated/ as read-only.",
    "Tests must be deterministic: seed random generators, avoid sleeps and never depend on the network.",
    "When you add a feature, add a test that fails without it and passes with it.",
    "Keep functions short and single-purpose; split a function when you cannot describe it in one sentence.",
    "Prefer the standard library over new helpers; prefer existing project helpers over the standard library.",
    "Check types with the project's type checker and fix new warnings your change introduces.",
    "When you rename a file, update every import and reference in documentation and configuration.",
    "Database migrations must be reversible; write the downgrade path alongside the upgrade.",
    "Public APIs change only with a deprecation path unless the task explicitly allows a breaking change.",
    "Log at the right level: debug for internals, info for lifecycle events, warning for recoverable problems.",
)
_TASKS = (
    "The function `parse_duration` in `{module}/timeparse.py` rejects inputs like '1h30m'. Make it accept compound durations and add tests.",
    "`{module}/cache.py` leaks entries when `invalidate()` is called during iteration. Find the cause and fix it without changing the public API.",
    "Add a `--dry-run` flag to the `sync` command in `{module}/cli.py` that prints the planned operations without executing them.",
    "The test `tests/test_{module}_io.py::test_roundtrip_unicode` fails on Windows line endings. Make the reader normalise newlines.",
    "Replace the hand-written retry loop in `{module}/client.py` with exponential backoff capped at 30 seconds, configurable per call.",
    "`{module}/report.py` builds large strings with `+=` in a loop and is slow on big inputs. Rewrite it to stream rows to the output file.",
    "Type-annotate `{module}/models.py` fully and make mypy pass in strict mode for that file.",
    "The JSON export in `{module}/export.py` loses timezone information. Emit ISO 8601 timestamps with offsets and update the schema docs.",
    "Split `{module}/handlers.py` (900 lines) into one module per resource without changing behaviour; keep imports working.",
    "Add pagination to `list_items` in `{module}/api.py`: `limit` and `cursor` parameters, with a stable sort order.",
)
_MODULES = ("billing", "inventory", "telemetry", "scheduler", "auth", "search", "ingest", "notify")


@dataclass(frozen=True)
class AgentScript:
    """One agent: its task and the tool result it receives after each of its turns but the last."""

    agent_id: str
    task: str
    tool_results: tuple[tuple[str, str], ...]  # (tool name, output) per later turn


@dataclass(frozen=True)
class Workload:
    """The whole swarm: what every agent shares and what each one owns."""

    system_prompt: str
    tools: tuple[dict[str, Any], ...]
    agents: tuple[AgentScript, ...]
    turns: int
    max_tokens: int


def initial_messages(workload: Workload, agent: AgentScript) -> list[Message]:
    """The first request of an agent: the shared system prompt, then its own task."""
    return [{"role": "system", "content": workload.system_prompt}, {"role": "user", "content": agent.task}]


def tool_result_message(agent: AgentScript, turn: int) -> Message:
    """The simulated tool output appended after the agent's reply in `turn` (0-based)."""
    name, output = agent.tool_results[turn]
    return {"role": "tool", "tool_call_id": f"call_{agent.agent_id}_{turn}", "name": name, "content": output}


def prefix_token_count(tokenizer: Tokenizer, system_prompt: str, tools: tuple[dict[str, Any], ...]) -> int:
    """Tokens of the rendered head that all agents share: everything before the first user message."""
    probes = [_render(tokenizer, system_prompt, tools, task) for task in ("alpha task", "omega job")]
    a, b = (tokenizer.encode(p) for p in probes)
    common = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        common += 1
    return common


def _render(tokenizer: Tokenizer, system_prompt: str, tools: tuple[dict[str, Any], ...], task: str) -> str:
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": task}]
    return tokenizer.apply_chat_template(messages, tools=list(tools))


def build_system_prompt(tokenizer: Tokenizer, prefix_tokens: int) -> tuple[str, tuple[dict[str, Any], ...]]:
    """Grow the harness's static head (rules, then tools) until the rendered prefix reaches `prefix_tokens`."""
    tools: tuple[dict[str, Any], ...] = CODING_TOOLS
    while tools and prefix_token_count(tokenizer, _ROLE, tools) > prefix_tokens:
        tools = tools[:-1]
    lines = [_ROLE, "", "Rules:"]
    section = 1
    while True:
        for rule in _RULES:
            candidate = [*lines, f"- {rule}"]
            if prefix_token_count(tokenizer, "\n".join(candidate), tools) > prefix_tokens:
                return "\n".join(lines), tools
            lines = candidate
        section += 1
        lines.append(f"\nRules, part {section} (repeated for emphasis in long sessions):")


def build_workload(
    tokenizer: Tokenizer,
    agents: int = 8,
    turns: int = 3,
    prefix_tokens: int = 2000,
    seed: int = 0,
    max_tokens: int = 48,
    tool_result_tokens: int = 200,
) -> Workload:
    """A deterministic swarm for `seed`: shared head near `prefix_tokens`, one task and tool trail per agent."""
    if agents <= 0 or turns <= 0 or prefix_tokens <= 0:
        raise ValueError("agents, turns and prefix_tokens must be positive")
    rng = random.Random(seed)
    system_prompt, tools = build_system_prompt(tokenizer, prefix_tokens)
    scripts = []
    for i in range(agents):
        module = agent_module(i)
        task = rng.choice(_TASKS).format(module=module) + f" (agent {i}, ticket #{rng.randrange(1000, 9999)})"
        results = tuple(_tool_result(rng, module, tool_result_tokens) for _ in range(turns - 1))
        scripts.append(AgentScript(agent_id=f"agent-{i}", task=task, tool_results=results))
    return Workload(system_prompt, tools, tuple(scripts), turns, max_tokens)


def agent_module(index: int) -> str:
    """The module agent `index` works on: named in its task and in its tools' output."""
    return _MODULES[index % len(_MODULES)] + ("" if index < len(_MODULES) else f"{index // len(_MODULES)}")


def tool_output_line(rng: random.Random, kind: str, module: str, n: int) -> str:
    """Line `n` (0-based) of a `read_file`, `run_tests` or `search_code` result about `module`."""
    if kind == "read_file":
        return f"{n + 1:4d}  {rng.choice(_CODE_LINES).format(m=module, n=rng.randrange(100))}"
    if kind == "run_tests":
        status = "PASSED" if rng.random() > 0.15 else "FAILED"
        return f"tests/test_{module}.py::test_case_{rng.randrange(1000)} {status}"
    return (
        f"src/{module}/{rng.choice(('core', 'api', 'util'))}.py:{rng.randrange(1, 500)}: "
        f"{rng.choice(_CODE_LINES).format(m=module, n=rng.randrange(100)).strip()}"
    )


def _tool_result(rng: random.Random, module: str, approx_tokens: int) -> tuple[str, str]:
    kind = rng.choice(("read_file", "run_tests", "search_code"))
    # About 12 tokens per line for these shapes of output.
    lines = [tool_output_line(rng, kind, module, n) for n in range(max(1, approx_tokens // 12))]
    return kind, "\n".join(lines)


_CODE_LINES = (
    "def handle_{m}_{n}(request):",
    "    value = cache.get(key, default=None)",
    "    if value is None:",
    "        raise {m}Error(f'missing entry {n}')",
    "    return {{'id': {n}, 'status': 'ok'}}",
    "import logging",
    "logger = logging.getLogger(__name__)",
    "class {m}Service:",
    "    def __init__(self, client, retries={n}):",
    "        self.client = client",
    "    for item in items[:{n}]:",
    "        total += item.amount",
)
