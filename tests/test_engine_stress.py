"""Differential stress: random multi-turn agent swarms on a tiny pool generate exactly what each prompt
generates alone, while the pool preempts, evicts, claims partial pages and aborts at random."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import cache

import pytest

from engine_helpers import TINY_VOCAB, tiny_llm
from swarmkv import SamplingParams
from swarmkv.core.sequence import Sequence
from swarmkv.engine.engine import LLMEngine

BLOCK = 4
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 8  # (K, V) x layers x KV heads x head dim x float64 bytes
SOLO_MAX_MODEL_LEN = 128
SALT = "tenant-b"
# Odd seeds abort at random; even seeds abort nothing, so their prompt accounting must be exact.
SEEDS = range(40)


# The tiny model's matmuls run hundreds of times slower when two BLAS threads contend for busy cores.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def greedy(max_tokens: int) -> SamplingParams:
    """Greedy decoding for exactly `max_tokens` tokens (the tiny vocabulary has no end-of-turn id anyway)."""
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@cache
def solo(prompt: tuple[int, ...], max_tokens: int) -> list[int]:
    """The prompt run alone on a fresh engine with no prefix cache and a pool it cannot outgrow."""
    engine = tiny_llm(
        kv_cache_memory=2 * SOLO_MAX_MODEL_LEN * KV_BYTES_PER_TOKEN,
        block_size=BLOCK,
        prefix_caching=False,
        max_model_len=SOLO_MAX_MODEL_LEN,
    ).engine
    engine.add_request("solo", list(prompt), greedy(max_tokens))
    tokens: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += delta.new_token_ids
    assert engine.counters.preemptions == 0
    return tokens


@dataclass
class Request:
    """One submitted request and what the engine streamed back for it."""

    prompt: list[int]
    max_tokens: int
    salt: str | None
    seq: Sequence
    agent: Agent | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    aborted: bool = False


@dataclass
class Agent:
    """A conversation: each turn's prompt is the last prompt, the last reply and a tool result."""

    salt: str | None
    prompt: list[int]
    turns_left: int
    due_step: int | None  # when the next turn is submitted; None while a turn is in flight or after the last


@dataclass
class SiblingGroup:
    """Requests with identical or near-identical prompts submitted in the same instant: a cold race."""

    due_step: int
    members: list[tuple[list[int], int, str | None]]  # prompt, max_tokens, salt


@dataclass
class Swarm:
    """One seed's engine, workload and bookkeeping."""

    seed: int
    engine: LLMEngine
    rng: random.Random
    max_len: int  # prompt + max_tokens of any request fits the context and the whole pool
    agents: list[Agent]
    groups: list[SiblingGroup]
    abort_rate: float
    requests: dict[str, Request] = field(default_factory=dict)
    step: int = 0

    def tokens(self, n: int) -> list[int]:
        """`n` random token ids."""
        return [self.rng.randrange(TINY_VOCAB) for _ in range(n)]

    def submit(
        self, prompt: list[int], max_tokens: int, salt: str | None, agent: Agent | None = None
    ) -> None:
        """Add a request to the engine and keep its live Sequence, which outlives the engine's bookkeeping."""
        rid = f"s{self.seed}r{len(self.requests)}"
        self.engine.add_request(rid, prompt, greedy(max_tokens), cache_salt=salt)
        seq = self.engine.get_sequence(rid)
        assert seq is not None
        self.requests[rid] = Request(list(prompt), max_tokens, salt, seq, agent)

    def submit_due(self) -> None:
        """Submit every agent turn and sibling group whose time has come."""
        for agent in self.agents:
            if agent.due_step is not None and agent.due_step <= self.step:
                agent.due_step = None
                max_tokens = self.rng.randint(1, 12)
                if len(agent.prompt) + max_tokens <= self.max_len:
                    self.submit(agent.prompt, max_tokens, agent.salt, agent)
                else:
                    agent.turns_left = 0  # the conversation outgrew the context: the agent stops
        for group in [g for g in self.groups if g.due_step <= self.step]:
            self.groups.remove(group)
            for prompt, max_tokens, salt in group.members:
                self.submit(prompt, max_tokens, salt)

    def next_due(self) -> int | None:
        """The earliest step at which something is still to be submitted."""
        dues = [a.due_step for a in self.agents if a.due_step is not None] + [g.due_step for g in self.groups]
        return min(dues, default=None)

    def maybe_abort(self) -> None:
        """With probability `abort_rate`, abort a random request the engine still holds."""
        live = [rid for rid, r in self.requests.items() if r.finish_reason is None and not r.aborted]
        if live and self.rng.random() < self.abort_rate:
            rid = self.rng.choice(live)
            assert self.engine.abort(rid), f"seed {self.seed}: {rid} is live but abort found nothing"
            self.engine.check_integrity()
            request = self.requests[rid]
            request.aborted = True
            self.continue_agent(request)

    def continue_agent(self, request: Request) -> None:
        """The agent builds its next turn from the reply so far (all of it, or what came before an abort)."""
        agent = request.agent
        if agent is None:
            return
        agent.turns_left -= 1
        if agent.turns_left > 0:
            agent.prompt = request.prompt + request.tokens + self.tokens(self.rng.randint(1, 6))
            # Mostly at once, as an agent whose tool is instant; sometimes later, after others evicted pages.
            agent.due_step = self.step + self.rng.choice([0, 0, 0, 1, 4])

    def receive(self) -> None:
        """Run one step and route its deltas."""
        for delta in self.engine.step():
            request = self.requests.get(delta.request_id)
            assert request is not None, f"seed {self.seed}: a delta for unknown {delta.request_id}"
            assert not request.aborted, f"seed {self.seed}: {delta.request_id} streamed after its abort"
            assert request.finish_reason is None, (
                f"seed {self.seed}: {delta.request_id} streamed after finishing"
            )
            assert delta.error is None, f"seed {self.seed}: {delta.request_id} failed: {delta.error}"
            request.tokens += delta.new_token_ids
            if delta.finished:
                request.finish_reason = delta.finish_reason
                self.continue_agent(request)
        self.step += 1


def build_swarm(seed: int) -> Swarm:
    """3-5 agents and 1-3 sibling groups sharing one head on a pool of 12-32 pages: most seeds preempt."""
    rng = random.Random(seed)
    num_pages = rng.randint(12, 32)
    max_len = min(96, num_pages * BLOCK)
    engine = tiny_llm(
        kv_cache_memory=num_pages * BLOCK * KV_BYTES_PER_TOKEN,
        block_size=BLOCK,
        max_num_batched_tokens=rng.choice([6, 8, 16, 32, 64]),
        max_num_seqs=rng.choice([3, 5, 64]),
        max_model_len=max_len,
        cascade_attention=rng.choice(["auto", "on", "off"]),
        prefix_caching=True,
        check_writes=True,
    ).engine
    head = [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(5, 14))]
    swarm = Swarm(seed, engine, rng, max_len, [], [], abort_rate=0.05 if seed % 2 else 0.0)
    for _ in range(rng.randint(3, 5)):
        salt = rng.choice([None, None, SALT])
        prompt = head + swarm.tokens(rng.randint(1, 8))
        swarm.agents.append(Agent(salt, prompt, turns_left=rng.randint(2, 4), due_step=rng.randint(0, 3)))
    for _ in range(rng.randint(1, 3)):
        base = head + swarm.tokens(rng.randint(0, 9))
        members = []
        for _ in range(rng.randint(2, 3)):
            variant = rng.choice(["same", "same", "last token", "one more", "one less"])
            prompt = {
                "same": base,
                "last token": base[:-1] + swarm.tokens(1),
                "one more": base + swarm.tokens(1),
                "one less": base[:-1],
            }[variant]
            max_tokens = min(rng.randint(1, 12), max_len - len(prompt))  # fits the context and the pool
            members.append((prompt, max_tokens, rng.choice([None, None, SALT])))
        swarm.groups.append(SiblingGroup(rng.randint(0, 16), members))
    return swarm


def check_accounting(swarm: Swarm) -> None:
    """Every prompt position is a hit or computed once; recomputation is counted apart."""
    stats = swarm.engine.stats()
    expected = stats["prompt_tokens"] - stats["prefix_hit_tokens"] + stats["recomputed_tokens"]
    assert stats["prefill_tokens_computed"] == expected, f"seed {swarm.seed} step {swarm.step}: {stats}"
    submitted = sum(len(r.prompt) for r in swarm.requests.values())
    assert stats["prompt_tokens"] <= submitted, f"seed {swarm.seed} step {swarm.step}: {stats}"


@cache
def run_swarm(seed: int) -> Swarm:
    """Drive one seed's swarm to the end, checking integrity and accounting after every step (cached: the
    coverage test reads the same runs as the per-seed tests)."""
    swarm = build_swarm(seed)
    engine = swarm.engine
    while True:
        swarm.submit_due()
        swarm.maybe_abort()
        check_accounting(swarm)
        if not engine.has_unfinished():
            due = swarm.next_due()
            if due is None:
                break
            swarm.step = max(swarm.step, due)  # nothing runs until the next submission: skip ahead
            continue
        swarm.receive()
        engine.check_integrity()
        check_accounting(swarm)
    return swarm


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def check_hits_stay_within_salts(swarm: Swarm) -> None:
    """A request's cache hit is KV that another request of its salt computed, so it is no longer than the
    prompt's common prefix with some such request's tokens: a hit past that leaked across salts."""
    requests = list(swarm.requests.items())
    for rid, request in requests:
        bound = max(
            (
                common_prefix(request.prompt, other.prompt + other.tokens)
                for other_rid, other in requests
                if other_rid != rid and other.salt == request.salt
            ),
            default=0,
        )
        hit = request.seq.num_cached_tokens
        assert hit <= bound, (
            f"seed {swarm.seed}: {rid} (salt {request.salt}) hit {hit} tokens; its salt has {bound}"
        )


@pytest.mark.parametrize("seed", SEEDS)
def test_agent_swarm_matches_solo_runs(seed: int) -> None:
    """Under preemption, eviction, partial-page claims, cold races, salts and aborts, every request
    generates what its prompt generates alone."""
    swarm = run_swarm(seed)
    engine = swarm.engine
    assert engine.core.kv.num_in_use == 0, f"seed {seed}: pages still held after every request ended"
    assert engine.core.kv.num_free + engine.core.kv.num_cached == engine.core.kv.num_pages
    engine.check_integrity()
    for rid, request in swarm.requests.items():
        expected = solo(tuple(request.prompt), request.max_tokens)
        if request.aborted:
            assert request.tokens == expected[: len(request.tokens)], f"seed {seed}: aborted {rid} diverged"
            continue
        assert request.finish_reason == "length", f"seed {seed}: {rid} ended with {request.finish_reason}"
        assert request.tokens == expected, (
            f"seed {seed}: {rid} (prompt {request.prompt}, max_tokens {request.max_tokens}, "
            f"salt {request.salt}) generated {request.tokens}, alone {expected}"
        )
    check_hits_stay_within_salts(swarm)
    stats = engine.stats()
    if not any(r.aborted for r in swarm.requests.values()):
        assert stats["prompt_tokens"] == sum(len(r.prompt) for r in swarm.requests.values()), f"seed {seed}"


def test_swarms_reach_the_paths_under_test() -> None:
    """The seeds, taken together, preempt, evict, hit the shared head, continue in a partly filled cached
    page and abort: a workload change that stops reaching one of them makes the suite test less."""
    swarms = [run_swarm(seed) for seed in SEEDS]
    totals = {
        key: sum(s.engine.stats()[key] for s in swarms)
        for key in ("preemptions", "evictions", "prefix_hit_tokens", "recomputed_tokens")
    }
    requests = [r for s in swarms for r in s.requests.values()]
    assert all(totals.values()), totals
    assert any(r.seq.num_cached_tokens % BLOCK for r in requests), "no request claimed a partial page"
    assert any(r.aborted and r.tokens for r in requests), "no request was aborted mid-generation"
    assert any(r.aborted and not r.tokens for r in requests), "no request was aborted before its first token"
    assert any(r.salt is not None and not r.aborted for r in requests), "no salted request ran to the end"
    assert sum(not r.aborted for r in requests) >= 10 * len(SEEDS), "too few requests ran to the end"
