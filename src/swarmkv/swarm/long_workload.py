"""The long-horizon swarm's workload: many turns per agent, tool results of varied sizes, seeded tool pauses,
subagents and history compaction.

Two habits of real agent harnesses shape what a KV cache should keep. About 44% of agent sessions spawn a
subagent (vLLM's published agent traces): a short session of its own, over the same head, whose report becomes
its parent's tool result and which is released when done. And a harness compacts a history that has grown too
long: the next prompt restarts after the task with a summary, and the old history is never read again.
"""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

from swarmkv.swarm.workload import (
    AgentScript,
    Message,
    Workload,
    agent_module,
    build_workload,
    initial_messages,
    tool_output_line,
    tool_result_message,
)
from swarmkv.tokenizer import Tokenizer

TOOL_PAUSE_MIN_S = 0.2
TOOL_PAUSE_MAX_S = 5.0
# Positions the chat template may add per turn around a reply beyond `max_tokens` (end-of-turn marks, a
# reply that re-tokenizes a little longer than it was sampled).
_TURN_MARGIN_TOKENS = 8


@dataclass(frozen=True)
class ToolKind:
    """One kind of tool result: how often an agent calls it and the size range of its output, in tokens."""

    name: str
    weight: float
    min_tokens: int
    max_tokens: int


# What a coding agent's tools return, by frequency: test summaries are short, file pages medium, and a
# wide search or a log dump now and then is large.
TOOL_MIX: tuple[ToolKind, ...] = (
    ToolKind("run_tests", 0.35, 60, 150),
    ToolKind("read_file", 0.45, 200, 1500),
    ToolKind("search_code", 0.12, 1500, 3000),
    ToolKind("run_command", 0.08, 2000, 4000),
)


# Share of agents that delegate one tool call to a subagent, and the subagent's turns.
SUBAGENT_SHARE = 0.44
SUBAGENT_TURNS = (2, 3)
_SUBTASKS = (
    "Find every caller of the functions in `{module}/core.py` and report each as file:line with one line of context.",
    "Run the `{module}` test suite, collect the failing tests and report each failure's first error line.",
    "Read `{module}/api.py` and list its public functions with their signatures and what they return.",
)


@dataclass(frozen=True)
class SubagentPlan:
    """A subagent its parent spawns after `after_turn`: a session of its own whose last reply becomes the
    parent's tool result."""

    after_turn: int
    script: AgentScript
    pauses_s: tuple[float, ...]  # after each of its turns but the last, unscaled


@dataclass(frozen=True)
class LongWorkload:
    """The swarm (shared head, tasks, tool results) plus each agent's tool pauses and final context size."""

    swarm: Workload
    pauses_s: tuple[tuple[float, ...], ...]  # [agent][turn]: the tool's run time after that turn, unscaled
    context_tokens: tuple[int, ...]  # each agent's final context, its replies counted at max_tokens
    subagents: tuple[SubagentPlan | None, ...] = ()  # per agent
    compact_tokens: int | None = None  # a prompt past this many tokens is compacted first

    @property
    def total_context_tokens(self) -> int:
        """The per-slot context: every agent's final context, summed (a shared head counted per agent)."""
        return sum(self.context_tokens)

    @property
    def spawned(self) -> list[SubagentPlan]:
        """The subagents, in their parents' order."""
        return [plan for plan in self.subagents if plan is not None]


def tool_pause_s(rng: random.Random) -> float:
    """A tool's run time, log-uniform in [0.2, 5] s: most calls are quick, a few take seconds."""
    pause = math.exp(rng.uniform(math.log(TOOL_PAUSE_MIN_S), math.log(TOOL_PAUSE_MAX_S)))
    return min(TOOL_PAUSE_MAX_S, max(TOOL_PAUSE_MIN_S, pause))


def build_long_workload(
    tokenizer: Tokenizer,
    agents: int,
    turns: int,
    prefix_tokens: int,
    seed: int,
    max_tokens: int,
    max_context_tokens: int,
    subagent_share: float = SUBAGENT_SHARE,
    compact_share: float | None = 0.8,
) -> LongWorkload:
    """A deterministic long swarm for `seed`; an agent whose tool results would outgrow `max_context_tokens`
    gets all of them shrunk by one factor, as a harness trims output when the context fills. A share of the
    agents spawn a subagent; a prompt longer than `compact_share` of the context is compacted (None: never)."""
    base = build_workload(
        tokenizer, agents=agents, turns=1, prefix_tokens=prefix_tokens, seed=seed, max_tokens=max_tokens
    )
    rng = random.Random(seed)
    scripts: list[AgentScript] = []
    pauses: list[tuple[float, ...]] = []
    contexts: list[int] = []
    for i, agent in enumerate(base.agents):
        kinds = rng.choices(TOOL_MIX, weights=[k.weight for k in TOOL_MIX], k=turns - 1)
        targets = [rng.randint(k.min_tokens, k.max_tokens) for k in kinds]
        pauses.append(tuple(tool_pause_s(rng) for _ in kinds))
        # Each output has its own seed, so a shrunk output is a prefix of the full one.
        seeds = [rng.randrange(2**32) for _ in kinds]
        fixed = _context_tokens(tokenizer, base, agent, [(k.name, "") for k in kinds], max_tokens)
        budget = max_context_tokens - fixed
        if budget < len(kinds):
            raise ValueError(
                f"agent {i}'s context needs {fixed} tokens before any tool output, more than the "
                f"{max_context_tokens} the model holds: lower --turns, --prefix-tokens or --max-tokens"
            )
        scale = min(1.0, budget / sum(targets)) if targets else 1.0
        while True:
            results = [
                (
                    k.name,
                    _sized_output(tokenizer, random.Random(s), k.name, agent_module(i), round(t * scale)),
                )
                for k, s, t in zip(kinds, seeds, targets, strict=True)
            ]
            context = _context_tokens(tokenizer, base, agent, results, max_tokens)
            if context <= max_context_tokens or scale < 1e-3:
                break
            scale *= 0.9 * max_context_tokens / context
        scripts.append(dataclasses.replace(agent, tool_results=tuple(results)))
        contexts.append(context)
    swarm = dataclasses.replace(base, agents=tuple(scripts), turns=turns)
    sub_rng = random.Random(seed + 1)  # its own stream: the agents' scripts do not change with the share
    subagents = tuple(
        _subagent(sub_rng, tokenizer, base, i, turns, max_context_tokens)
        if turns > 1 and sub_rng.random() < subagent_share
        else None
        for i in range(agents)
    )
    compact = None if compact_share is None else int(compact_share * max_context_tokens)
    return LongWorkload(swarm, tuple(pauses), tuple(contexts), subagents, compact)


def _subagent(
    rng: random.Random, tokenizer: Tokenizer, base: Workload, parent: int, turns: int, max_context_tokens: int
) -> SubagentPlan:
    """A subagent of agent `parent`, spawned after one of its turns but the last, with small tool results
    that fit its context."""
    module = agent_module(parent)
    task = rng.choice(_SUBTASKS).format(module=module) + f" (delegated by agent {parent})"
    num_turns = rng.choice(SUBAGENT_TURNS)
    kinds = rng.choices(TOOL_MIX[:2], k=num_turns - 1)
    script = AgentScript(agent_id=f"agent-{parent}/sub", task=task, tool_results=())
    fixed = _context_tokens(tokenizer, base, script, [(k.name, "") for k in kinds], base.max_tokens)
    cap = max(1, min(600, (max_context_tokens - fixed) // len(kinds) - _TURN_MARGIN_TOKENS))
    results = []
    for k in kinds:
        size = min(cap, rng.randint(k.min_tokens, k.max_tokens))
        output = _sized_output(tokenizer, random.Random(rng.randrange(2**32)), k.name, module, size)
        results.append((k.name, output))
    script = dataclasses.replace(script, tool_results=tuple(results))
    return SubagentPlan(rng.randrange(turns - 1), script, tuple(tool_pause_s(rng) for _ in kinds))


def compacted(messages: list[Message]) -> list[Message]:
    """A harness's compaction of a long history: the system prompt, then one user message with the task, a
    summary (here: the agent's latest replies) and the latest tool output. The old history is not read again."""
    system, task = messages[0], messages[1]
    replies = [str(m["content"]) for m in messages if m["role"] == "assistant"][-3:]
    latest = str(messages[-1]["content"]) if messages[-1]["role"] == "tool" else ""
    summary = (
        f"{task['content']}\n\nThe earlier turns were compacted. Your latest notes:\n"
        + "\n---\n".join(replies)
        + f"\n\nLatest tool output:\n{latest}"
    )
    return [system, {"role": "user", "content": summary}]


def _context_tokens(
    tokenizer: Tokenizer,
    workload: Workload,
    agent: AgentScript,
    results: list[tuple[str, str]],
    max_tokens: int,
) -> int:
    """An agent's final context: the last turn's prompt with empty replies, plus every reply at full length."""
    scripted = dataclasses.replace(agent, tool_results=tuple(results))
    messages: list[Message] = initial_messages(workload, scripted)
    for turn in range(len(results)):
        messages += [{"role": "assistant", "content": ""}, tool_result_message(scripted, turn)]
    prompt = tokenizer.apply_chat_template(messages, tools=list(workload.tools))
    turns = len(results) + 1
    return len(tokenizer.encode(prompt)) + turns * (max_tokens + _TURN_MARGIN_TOKENS)


def _sized_output(tokenizer: Tokenizer, rng: random.Random, kind: str, module: str, num_tokens: int) -> str:
    """Whole lines of a `kind` result, as many as fit in `num_tokens` (at least one)."""
    lines: list[str] = []
    used = 0
    while True:
        line = _output_line(rng, kind, module, len(lines))
        cost = len(tokenizer.encode(line + "\n"))
        if lines and used + cost > num_tokens:
            return "\n".join(lines)
        lines.append(line)
        used += cost


def _output_line(rng: random.Random, kind: str, module: str, n: int) -> str:
    if kind != "run_command":
        return tool_output_line(rng, kind, module, n)
    # A build or service log: the large, repetitive output an agent gets from a failing command.
    level = rng.choices(("INFO", "DEBUG", "WARNING", "ERROR"), weights=(6, 3, 2, 1))[0]
    return (
        f"2024-05-{rng.randint(1, 28):02d}T{rng.randrange(24):02d}:{rng.randrange(60):02d}:"
        f"{rng.randrange(60):02d}.{rng.randrange(1000):03d} {level:<7} {module}.{rng.choice(_COMPONENTS)}: "
        f"{rng.choice(_LOG_MESSAGES).format(n=rng.randrange(10_000))}"
    )


_COMPONENTS = ("worker", "db", "http", "cache", "queue", "scheduler")
_LOG_MESSAGES = (
    "processed batch {n} in 12ms",
    "retrying request {n} after timeout",
    "connection pool exhausted, waiting for a free slot ({n} queued)",
    "cache miss for key item:{n}",
    "committed transaction {n}",
    "slow query took {n}ms: SELECT * FROM items WHERE owner_id = $1",
    "Traceback (most recent call last): KeyError: 'item-{n}'",
)
