"""Run the long-horizon swarm on the in-process engine under one KV retention policy, in wall-clock time."""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from swarmkv.engine.config import EngineConfig
from swarmkv.engine.engine import LLMEngine
from swarmkv.engine.sampling_params import SamplingParams
from swarmkv.models.loader import LoadedModel
from swarmkv.swarm.long_workload import LongWorkload
from swarmkv.swarm.workload import Message, initial_messages, tool_result_message

Policy = Literal["lru", "session", "session+offload"]
POLICIES: tuple[Policy, ...] = ("lru", "session", "session+offload")


def policy_config(base: EngineConfig, policy: Policy, offload_bytes: int, num_agents: int) -> EngineConfig:
    """`base` with the policy's retention and host tier, one running request per agent, prefix index on."""
    return dataclasses.replace(
        base,
        retention="lru" if policy == "lru" else "session",
        offload_memory=offload_bytes if policy == "session+offload" else 0,
        max_num_seqs=num_agents,
        prefix_caching=True,
    )


@dataclass(frozen=True)
class KVSample:
    """The KV state after one engine step; `time_s` counts from the start of the run."""

    time_s: float
    device_bytes: int
    host_bytes: int
    recomputed_tokens: int


@dataclass
class PolicyResult:
    """What one policy measured; bytes are KV bytes, times are seconds, counters are totals of the run."""

    policy: Policy
    prefill_tokens_computed: int = 0
    recomputed_tokens: int = 0
    prefix_hit_tokens: int = 0
    evictions: int = 0
    offload_loads: int = 0
    offload_load_bytes: int = 0
    offload_stores: int = 0
    offload_drops: int = 0
    preemptions: int = 0
    swap_preemptions: int = 0
    recompute_preemptions: int = 0
    peak_kv_bytes: int = 0
    peak_offloaded_bytes: int = 0
    pool_bytes: int = 0
    wall_s: float = 0.0
    ttft_s: list[list[float]] = field(default_factory=list)  # [agent][turn], from the turn being due
    token_ids: list[list[list[int]]] = field(default_factory=list)  # [agent][turn]: the generated ids
    timeline: list[KVSample] = field(default_factory=list)

    @property
    def transcript_sha256(self) -> str:
        """A digest of every generated token id, agents in order, turns in order."""
        return hashlib.sha256(json.dumps(self.token_ids).encode()).hexdigest()


ProgressFn = Callable[[int, int, PolicyResult], None]


def run_long_swarm(
    loaded: LoadedModel,
    long: LongWorkload,
    policy: Policy,
    config: EngineConfig,
    time_scale: float = 1.0,
    progress: ProgressFn | None = None,
) -> PolicyResult:
    """Agents run their turns one session each; between turns an agent waits out its tool's scaled pause, so
    the agents drift apart; after its last turn it releases its session."""
    workload = long.swarm
    agents = workload.agents
    engine = LLMEngine(loaded, config)
    tokenizer = loaded.tokenizer
    result = PolicyResult(
        policy,
        ttft_s=[[] for _ in agents],
        token_ids=[[] for _ in agents],
        pool_bytes=engine.kv.num_pages * engine.page_bytes,
    )
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0)
    messages: list[list[Message]] = [initial_messages(workload, a) for a in agents]
    index_of = {a.agent_id: i for i, a in enumerate(agents)}
    turn_of = [0] * len(agents)
    due_at: dict[str, float] = {}  # request id -> when its agent was ready to send it
    replies: dict[str, list[str]] = {}
    pending: list[tuple[float, int]] = []  # (due time, agent): turns waiting out a tool pause
    total_turns = len(agents) * workload.turns
    done_turns = 0

    def submit(i: int, due: float) -> None:
        ids = tokenizer.encode(tokenizer.apply_chat_template(messages[i], tools=list(workload.tools)))
        rid = f"{agents[i].agent_id}/turn-{turn_of[i]}"
        engine.add_request(rid, ids, params, session_id=agents[i].agent_id)
        due_at[rid] = due
        replies[rid] = []
        result.token_ids[i].append([])

    start = time.perf_counter()
    for i in range(len(agents)):
        submit(i, start)
    while engine.has_unfinished() or pending:
        now = time.perf_counter()
        while pending and pending[0][0] <= now:
            due, i = heapq.heappop(pending)
            submit(i, due)
        if not engine.has_unfinished():
            # Every agent is waiting on a tool: nothing to compute until the next one is due.
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        deltas = engine.step()
        now = time.perf_counter()
        stats = engine.stats()
        result.timeline.append(
            KVSample(
                now - start, stats["kv_bytes_used"], stats["offloaded_bytes"], stats["recomputed_tokens"]
            )
        )
        for delta in deltas:
            if delta.error is not None:
                raise RuntimeError(f"{delta.request_id} failed: {delta.error}")
            i = index_of[delta.request_id.split("/")[0]]
            if not replies[delta.request_id] and delta.new_token_ids:
                result.ttft_s[i].append(now - due_at[delta.request_id])
            replies[delta.request_id].append(delta.new_text)
            result.token_ids[i][-1].extend(delta.new_token_ids)
            if not delta.finished:
                continue
            done_turns += 1
            messages[i].append({"role": "assistant", "content": "".join(replies.pop(delta.request_id))})
            if turn_of[i] + 1 < workload.turns:
                messages[i].append(tool_result_message(agents[i], turn_of[i]))
                heapq.heappush(pending, (now + long.pauses_s[i][turn_of[i]] * time_scale, i))
                turn_of[i] += 1
            else:
                engine.release_session(agents[i].agent_id)
            if progress is not None:
                progress(done_turns, total_turns, result)
    result.wall_s = time.perf_counter() - start
    _read_counters(engine, result)
    engine.check_integrity()
    return result


def _read_counters(engine: LLMEngine, result: PolicyResult) -> None:
    stats = engine.stats()
    for name in (
        "prefill_tokens_computed",
        "recomputed_tokens",
        "prefix_hit_tokens",
        "evictions",
        "offload_loads",
        "offload_load_bytes",
        "offload_stores",
        "offload_drops",
        "preemptions",
        "swap_preemptions",
        "recompute_preemptions",
    ):
        setattr(result, name, stats[name])
    result.peak_kv_bytes = stats["peak_kv_bytes_used"]
    result.peak_offloaded_bytes = max((s.host_bytes for s in result.timeline), default=0)
