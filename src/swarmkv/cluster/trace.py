"""A synthetic multi-swarm trace: token ids only, no model and no tokenizer.

Each swarm has its own head (system prompt and tool schemas). Each of its agents starts from that head and its
own task; every turn's prompt is the agent's previous prompt, the reply the model gave to it and the tool's
result. The swarms start at random times over a window and all agents of a swarm start together (a cold
swarm's burst); an agent's next turn arrives a random think-and-tool gap after its previous one, so the
arrivals of all swarms and agents interleave. One seed fixes everything.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import chain

VOCAB_SIZE = 32_000
MIN_TURN_GAP_S = 3.0  # the fastest reply-plus-tool round trip


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

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            least = 0 if field.name == "seed" else 1
            if value < least:
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
    segments: tuple[tuple[int, ...], ...]  # head, task, then per earlier turn its reply and tool result
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
    """The requests in arrival order, and each swarm's head."""

    config: TraceConfig
    requests: tuple[TraceRequest, ...]
    heads: tuple[tuple[int, ...], ...]

    @property
    def num_unique_tokens(self) -> int:
        """Tokens of every distinct segment: what one cache holding the whole trace would store."""
        agent_tokens = {
            (r.swarm, r.agent): sum(len(s) for s in r.segments[1:]) + len(r.reply) for r in self.requests
        }
        return sum(len(h) for h in self.heads) + sum(agent_tokens.values())


def make_trace(config: TraceConfig) -> Trace:
    """The seeded trace for `config`."""
    rng = random.Random(config.seed)
    vocab = list(range(VOCAB_SIZE))  # drawn from a list, so the ids are shared int objects

    def draw(mean: int) -> tuple[int, ...]:
        return tuple(rng.choices(vocab, k=rng.randint(max(1, mean // 2), max(1, mean * 3 // 2))))

    requests: list[TraceRequest] = []
    heads: list[tuple[int, ...]] = []
    for swarm in range(config.swarms):
        # Two leading ids spell the swarm's number: every head differs from the first page on.
        head = (swarm // VOCAB_SIZE, swarm % VOCAB_SIZE, *draw(config.head_tokens))
        heads.append(head)
        start = rng.uniform(0.0, config.window_s)
        for agent in range(config.agents):
            arrival = start + rng.uniform(0.0, 1.0)
            segments: Sequence[tuple[int, ...]] = (head, draw(config.task_tokens))
            for turn in range(config.turns):
                reply = draw(config.reply_tokens)
                requests.append(TraceRequest(arrival, swarm, agent, turn, tuple(segments), reply))
                segments = (*segments, reply, draw(config.tool_tokens))
                arrival += MIN_TURN_GAP_S + rng.expovariate(1.0 / (config.turn_gap_s - MIN_TURN_GAP_S + 1e-9))
    requests.sort(key=lambda r: (r.arrival_s, r.swarm, r.agent, r.turn))
    return Trace(config, tuple(requests), tuple(heads))
