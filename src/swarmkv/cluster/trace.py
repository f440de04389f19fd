"""A synthetic multi-swarm trace: token ids only, no model and no tokenizer.

Two shapes of first request:
- `synthetic`: each swarm has its own head (system prompt and tool schemas, `head_tokens`), and each of its
  agents starts from that head and its own task (`task_tokens`).
- `harness`: each swarm is eight-or-so instances of one coding harness, and every swarm of a harness shares
  that harness's one head, as instances of one release do. A harness's first request has the size measured
  with the real harnesses (`HARNESSES`), and its first per-instance text (Claude Code's git branch, Qwen Code's
  and Codex's environment lines) where they put it: past that point a prefix cache shares nothing, so the rest
  of the first request is drawn per instance.
Every turn's prompt is then the agent's previous prompt, the reply the model gave to it and the tool's result.
The swarms start at random times over a window and all agents of a swarm start together (a cold swarm's
burst); an agent's next turn arrives a random think-and-tool gap after its previous one, so the arrivals of
all swarms and agents interleave. One seed fixes everything.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import chain
from typing import Literal

VOCAB_SIZE = 32_000
MIN_TURN_GAP_S = 3.0  # the fastest reply-plus-tool round trip
TraceShape = Literal["synthetic", "harness"]
TRACE_SHAPES: tuple[TraceShape, ...] = ("synthetic", "harness")


@dataclass(frozen=True)
class HarnessShape:
    """A harness's first request: the prefix all its instances share, up to the first per-instance text."""

    name: str
    shared_tokens: int  # from the first token to the first per-instance text
    first_request_tokens: int  # the whole first request, the instance's own text and task included

    @property
    def instance_tokens(self) -> int:
        """The first request's tokens from the first per-instance text on."""
        return self.first_request_tokens - self.shared_tokens


# Measured with eight instances of each pinned release against one server (docs/benchmarks.md, "The coding
# harnesses"): what instances 2-8 read from the cache of their first request, and its size.
HARNESSES = (
    HarnessShape("claude-code", 9_408, 11_911),  # 2.1.332: up to the worktree's git branch, 79.0%
    HarnessShape("codex", 8_500, 8_620),  # 0.171.0: 98.6-98.7%
    HarnessShape("qwen-code", 14_032, 17_422),  # 0.24.4, tools first: 80.5%
)


@dataclass(frozen=True)
class TraceConfig:
    """The trace's shape; token counts are means, each segment drawn between half and one and a half times."""

    swarms: int = 4
    agents: int = 8
    turns: int = 4
    head_tokens: int = 2000
    task_tokens: int = 200
    reply_tokens: int = 100
    tool_tokens: int = 200
    window_s: float = 600.0  # swarms start uniformly over this window
    turn_gap_s: float = 15.0  # mean gap between an agent's turns
    seed: int = 0
    shape: TraceShape = "synthetic"  # harness: first requests shaped as HARNESSES' (head and task unused)

    def __post_init__(self) -> None:
        if self.shape not in TRACE_SHAPES:
            raise ValueError(f"trace shape must be one of {', '.join(TRACE_SHAPES)}, got {self.shape!r}")
        for field in fields(self):
            value = getattr(self, field.name)
            least = 0 if field.name == "seed" else 1
            if field.name != "shape" and value < least:
                raise ValueError(f"{field.name.replace('_', '-')} must be at least {least}, got {value}")
        if self.turn_gap_s < MIN_TURN_GAP_S:
            raise ValueError(f"turn-gap-s must be at least {MIN_TURN_GAP_S}, got {self.turn_gap_s}")


@dataclass(frozen=True)
class TraceRequest:
    """One agent turn: its prompt (kept as the shared segments it is made of) and the reply it generates."""

    arrival_s: float
    swarm: int
    agent: int
    turn: int
    # head, task (or instance text), then each earlier turn's reply and tool result
    segments: tuple[tuple[int, ...], ...]
    reply: tuple[int, ...]

    @property
    def session(self) -> str:
        """The agent's session id: one per agent, across its turns."""
        return f"swarm{self.swarm}-agent{self.agent}"

    @property
    def prompt(self) -> list[int]:
        """The prompt's token ids."""
        return list(chain.from_iterable(self.segments))

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return sum(len(segment) for segment in self.segments)


@dataclass(frozen=True)
class Trace:
    """The requests in arrival order, and each swarm's head (one harness's swarms share theirs)."""

    config: TraceConfig
    requests: tuple[TraceRequest, ...]
    heads: tuple[tuple[int, ...], ...]

    @property
    def num_unique_tokens(self) -> int:
        """Tokens of every distinct segment: what one cache holding the whole trace would store."""
        agent_tokens = {
            (r.swarm, r.agent): sum(len(s) for s in r.segments[1:]) + len(r.reply) for r in self.requests
        }
        return sum(len(h) for h in dict.fromkeys(self.heads)) + sum(agent_tokens.values())


def make_trace(config: TraceConfig) -> Trace:
    """The seeded trace for `config`."""
    rng = random.Random(config.seed)
    vocab = list(range(VOCAB_SIZE))  # drawn from a list, so the ids are shared int objects

    def draw(mean: int) -> tuple[int, ...]:
        return tuple(rng.choices(vocab, k=rng.randint(max(1, mean // 2), max(1, mean * 3 // 2))))

    # Two leading ids spell the swarm's (or harness's) number: every head differs from the first page on.
    harness_heads = [
        (i // VOCAB_SIZE, i % VOCAB_SIZE, *rng.choices(vocab, k=h.shared_tokens - 2))
        for i, h in enumerate(HARNESSES if config.shape == "harness" else ())
    ]
    requests: list[TraceRequest] = []
    heads: list[tuple[int, ...]] = []
    for swarm in range(config.swarms):
        if harness_heads:  # the swarms take the harnesses in turn
            head = harness_heads[swarm % len(HARNESSES)]
            own_tokens = HARNESSES[swarm % len(HARNESSES)].instance_tokens
        else:
            head = (swarm // VOCAB_SIZE, swarm % VOCAB_SIZE, *draw(config.head_tokens))
            own_tokens = config.task_tokens
        heads.append(head)
        start = rng.uniform(0.0, config.window_s)
        for agent in range(config.agents):
            arrival = start + rng.uniform(0.0, 1.0)
            segments: Sequence[tuple[int, ...]] = (head, draw(own_tokens))
            for turn in range(config.turns):
                reply = draw(config.reply_tokens)
                requests.append(TraceRequest(arrival, swarm, agent, turn, tuple(segments), reply))
                segments = (*segments, reply, draw(config.tool_tokens))
                arrival += MIN_TURN_GAP_S + rng.expovariate(1.0 / (config.turn_gap_s - MIN_TURN_GAP_S + 1e-9))
    requests.sort(key=lambda r: (r.arrival_s, r.swarm, r.agent, r.turn))
    return Trace(config, tuple(requests), tuple(heads))
