"""Run the long-horizon swarm on the in-process engine under one KV retention policy, in wall-clock time."""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from swarmkv.core.config import EngineConfig
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.engine.engine import LLMEngine
from swarmkv.kv.retention import RetentionPolicy
from swarmkv.models.loader import LoadedModel
from swarmkv.swarm.long_workload import TOOL_PAUSE_MIN_S, LongWorkload, compacted
from swarmkv.swarm.replay import ReplayExecutor
from swarmkv.swarm.workload import AgentScript, Message, initial_messages, tool_result_message

# A harness compacts a history at most this often: a compacted history has room to grow again.
COMPACT_EVERY_TURNS = 4
Policy = Literal["lru", "session", "return", "session+offload", "belady"]
POLICIES: tuple[Policy, ...] = ("lru", "session", "return", "session+offload", "belady")
# `belady` is a bound, not a policy an engine can run: `return` told each paused session's true next turn by
# the driver, which knows every tool's pause and whether the next prompt is compacted. A parent's wait on its
# subagent is the one thing it guesses: the subagent's pauses plus this much compute a turn.
ORACLE_TURN_S = 1.0
RETENTION_OF: dict[Policy, RetentionPolicy] = {
    "lru": "lru",
    "session": "session",
    "return": "return",
    "session+offload": "session",
    "belady": "return",
}
# Compared when --policies is not given; `return` and the `belady` bound are compared when named.
DEFAULT_POLICIES: tuple[Policy, ...] = ("lru", "session", "session+offload")


def policy_config(base: EngineConfig, policy: Policy, offload_bytes: int, num_agents: int) -> EngineConfig:
    """`base` with the policy's retention and host tier, one running request per agent, prefix index on."""
    return dataclasses.replace(
        base,
        retention=RETENTION_OF[policy],
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
    subagents: int = 0  # subagent sessions spawned
    compactions: int = 0  # histories the harness compacted

    @property
    def transcript_sha256(self) -> str:
        """A digest of every generated token id, agents in order, turns in order."""
        return hashlib.sha256(json.dumps(self.token_ids).encode()).hexdigest()


ProgressFn = Callable[[int, int, PolicyResult], None]
ClockName = Literal["wall", "model"]
CLOCKS: tuple[ClockName, ...] = ("wall", "model")


class WallClock:
    """The run's time is the wall's: a step takes what it takes on this machine under its load."""

    def now(self) -> float:
        """Seconds, from an arbitrary start."""
        return time.perf_counter()

    def wait_until(self, t: float) -> None:
        """Sleep until `t`."""
        time.sleep(max(0.0, t - self.now()))

    def stepped(self, num_tokens: int) -> None:
        """A step computed `num_tokens` tokens: it already took its time."""


@dataclass
class ModelledClock:
    """The run's time moves only by a cost model: a step takes `step_s` plus `token_s` per token it computes
    (prefill chunks and decode rows), a wait takes no wall time. The same workload and policy then take the
    same steps in the same order on any machine at any load, so counters and times repeat exactly. The
    defaults are of the order of the embedded model's float steps on a 2-core CPU (a turn about a second)."""

    step_s: float = 0.03
    token_s: float = 0.0005
    now_s: float = 0.0

    def now(self) -> float:
        """Modelled seconds since the run started."""
        return self.now_s

    def wait_until(self, t: float) -> None:
        """Jump to `t`."""
        self.now_s = max(self.now_s, t)

    def stepped(self, num_tokens: int) -> None:
        """A step computed `num_tokens` tokens: time moves by its modelled cost."""
        self.now_s += self.step_s + self.token_s * num_tokens


Clock = WallClock | ModelledClock


@dataclass
class _Worker:
    """An agent or a subagent: one session running its script's turns."""

    session_id: str
    script: AgentScript
    pauses_s: tuple[float, ...]
    messages: list[Message] = field(default_factory=list)
    turn: int = 0
    parent: int | None = None  # a subagent's parent, by worker index
    subagent: int | None = None  # the subagent an agent spawns after turn `spawn_after`
    spawn_after: int | None = None
    compacted_at: int = 0  # the turn of its latest compaction (0: none yet)

    @property
    def num_turns(self) -> int:
        """Turns in its script: one per tool result, plus the last."""
        return len(self.script.tool_results) + 1


def session_ids(long: LongWorkload) -> list[str]:
    """Each worker's session, in the order of a result's rows."""
    return [w.session_id for w in _workers(long)]


def _workers(long: LongWorkload) -> list[_Worker]:
    """Agents first, then their subagents in the agents' order (rows of the results, in that order)."""
    workload = long.swarm
    workers = [
        _Worker(a.agent_id, a, long.pauses_s[i], initial_messages(workload, a))
        for i, a in enumerate(workload.agents)
    ]
    for i, plan in enumerate(long.subagents):
        if plan is not None:
            workers[i].subagent, workers[i].spawn_after = len(workers), plan.after_turn
            messages = initial_messages(workload, plan.script)
            workers.append(_Worker(plan.script.agent_id, plan.script, plan.pauses_s, messages, parent=i))
    return workers


def run_long_swarm(
    loaded: LoadedModel,
    long: LongWorkload,
    policy: Policy,
    config: EngineConfig,
    time_scale: float = 1.0,
    progress: ProgressFn | None = None,
    clock: Clock | None = None,
    recorded: dict[str, list[int]] | None = None,
) -> PolicyResult:
    """Agents run their turns one session each; between turns an agent waits out its tool's scaled pause, so
    the agents drift apart. An agent with a subagent spawns it after one turn and waits for its report; a
    prompt past the compaction threshold is compacted first. A finished session is released. Times are the
    wall's unless `clock` is a ModelledClock (a fresh one per run). With `recorded` (request id -> token ids, as
    a run recorded them) the model does not run: each turn's reply is the recorded one (`replay.py`)."""
    clock = clock or WallClock()
    workload = long.swarm
    engine = LLMEngine(loaded, config)
    if recorded is not None:
        engine.executor = ReplayExecutor(recorded)  # type: ignore[assignment]
    tokenizer = loaded.tokenizer
    workers = _workers(long)
    result = PolicyResult(
        policy,
        ttft_s=[[] for _ in workers],
        token_ids=[[] for _ in workers],
        pool_bytes=engine.core.kv.num_pages * engine.page_bytes,
    )
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0)
    index_of = {w.session_id: i for i, w in enumerate(workers)}
    due_at: dict[str, float] = {}  # request id -> when its agent was ready to send it
    replies: dict[str, list[str]] = {}
    pending: list[tuple[float, int]] = []  # (due time, worker): turns waiting out a tool pause
    total_turns = sum(w.num_turns for w in workers)
    done_turns = 0

    def render(w: _Worker) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template(w.messages, tools=list(workload.tools)))

    def submit(i: int, due: float) -> None:
        w = workers[i]
        ids = render(w)
        if _compacts(long, w, len(ids)):
            w.compacted_at = w.turn
            w.messages = compacted(w.messages)
            ids = render(w)
            result.compactions += 1
        while len(ids) > engine.max_model_len - workload.max_tokens:  # a harness truncates what cannot fit
            last = w.messages[-1]
            content = str(last["content"])
            w.messages[-1] = {**last, "content": content[: len(content) // 2] + "\n[output truncated]"}
            ids = render(w)
        rid = f"{w.session_id}/turn-{w.turn}"
        engine.add_request(rid, ids, params, session_id=w.session_id)
        due_at[rid] = due
        replies[rid] = []
        result.token_ids[i].append([])

    if isinstance(clock, ModelledClock):
        engine.core.kv.retention.clock = clock.now  # tool pauses are timed on the run's clock
    start = clock.now()
    for i, w in enumerate(workers):
        if w.parent is None:
            submit(i, start)
    computed = 0  # prefill tokens computed so far
    while engine.has_unfinished() or pending:
        now = clock.now()
        while pending and pending[0][0] <= now:
            due, i = heapq.heappop(pending)
            submit(i, due)
        if not engine.has_unfinished():
            # Every agent is waiting on a tool: nothing to compute until the next one is due.
            clock.wait_until(pending[0][0])
            continue
        deltas = engine.step()
        stats = engine.snapshot()
        clock.stepped(stats.prefill_tokens_computed - computed + len(deltas))
        computed = stats.prefill_tokens_computed
        now = clock.now()
        result.timeline.append(
            KVSample(now - start, stats.kv_bytes_used, stats.offloaded_bytes, stats.recomputed_tokens)
        )
        for delta in deltas:
            if delta.error is not None:
                raise RuntimeError(f"{delta.request_id} failed: {delta.error}")
            i = index_of[delta.request_id.rsplit("/turn-", 1)[0]]
            if not replies[delta.request_id] and delta.new_token_ids:
                result.ttft_s[i].append(now - due_at[delta.request_id])
            replies[delta.request_id].append(delta.new_text)
            result.token_ids[i][-1].extend(delta.new_token_ids)
            if not delta.finished:
                continue
            done_turns += 1
            reply = "".join(replies.pop(delta.request_id))
            finished_turn = workers[i].turn
            _next_turn(engine, workers, i, reply, now, time_scale, pending, submit, result)
            if policy == "belady":
                _tell_oracle(engine, long, workers, i, finished_turn, time_scale, render)
            if progress is not None:
                progress(done_turns, total_turns, result)
    result.wall_s = clock.now() - start
    _read_counters(engine, result)
    engine.check_integrity()
    return result


def _compacts(long: LongWorkload, w: _Worker, num_tokens: int) -> bool:
    """Whether the harness compacts the worker's history before its next turn, whose prompt has `num_tokens`."""
    return (
        long.compact_tokens is not None
        and w.parent is None
        and num_tokens > long.compact_tokens
        and w.turn - w.compacted_at >= COMPACT_EVERY_TURNS
    )


def _tell_oracle(
    engine: LLMEngine,
    long: LongWorkload,
    workers: list[_Worker],
    i: int,
    finished_turn: int,
    time_scale: float,
    render: Callable[[_Worker], list[int]],
) -> None:
    """`belady`: after worker `i`'s turn `finished_turn`, tell the retention when each session it affects next
    uses its pages: its own after its tool's pause, its parent's after its report; never, where the next prompt
    is compacted."""
    retention = engine.core.kv.retention
    w = workers[i]
    if finished_turn + 1 >= w.num_turns:  # its last: a subagent's parent is due once the report is in
        if w.parent is not None:
            parent = workers[w.parent]
            compacts = _compacts(long, parent, len(render(parent)))
            retention.expect_return(
                parent.session_id, math.inf if compacts else TOOL_PAUSE_MIN_S * time_scale
            )
        return
    if w.subagent is not None and finished_turn == w.spawn_after:
        sub = workers[w.subagent]
        wait_s = (sum(sub.pauses_s) + TOOL_PAUSE_MIN_S) * time_scale + sub.num_turns * ORACLE_TURN_S
        retention.expect_return(w.session_id, wait_s)
        return
    compacts = _compacts(long, w, len(render(w)))
    retention.expect_return(w.session_id, math.inf if compacts else w.pauses_s[finished_turn] * time_scale)


def _next_turn(
    engine: LLMEngine,
    workers: list[_Worker],
    i: int,
    reply: str,
    now: float,
    time_scale: float,
    pending: list[tuple[float, int]],
    submit: Callable[[int, float], None],
    result: PolicyResult,
) -> None:
    """After worker `i` finished a turn: its tool runs (or its subagent starts), or its session ends and a
    subagent's report goes to its parent."""
    w = workers[i]
    w.messages.append({"role": "assistant", "content": reply})
    if w.turn + 1 < w.num_turns:
        if w.subagent is not None and w.turn == w.spawn_after:
            result.subagents += 1
            engine.core.note_tool_call(w.session_id, "delegate_task")
            submit(w.subagent, now)  # the parent's tool call is its subagent: it waits for the report
        else:
            w.messages.append(tool_result_message(w.script, w.turn))
            engine.core.note_tool_call(
                w.session_id, w.script.tool_results[w.turn][0]
            )  # the harness parsed it
            heapq.heappush(pending, (now + w.pauses_s[w.turn] * time_scale, i))
        w.turn += 1
        return
    engine.release_session(w.session_id)
    if w.parent is not None:
        parent = workers[w.parent]
        report = {
            "role": "tool",
            "tool_call_id": f"call_{parent.session_id}_{parent.turn - 1}",
            "name": "delegate_task",
            "content": f"Subagent report:\n{reply}",
        }
        parent.messages.append(report)
        heapq.heappush(pending, (now + TOOL_PAUSE_MIN_S * time_scale, w.parent))


def _read_counters(engine: LLMEngine, result: PolicyResult) -> None:
    stats = engine.snapshot()
    result.prefill_tokens_computed = stats.prefill_tokens_computed
    result.recomputed_tokens = stats.recomputed_tokens
    result.prefix_hit_tokens = stats.prefix_hit_tokens
    result.evictions = stats.evictions
    result.offload_loads = stats.offload_loads
    result.offload_load_bytes = stats.offload_load_bytes
    result.offload_stores = stats.offload_stores
    result.offload_drops = stats.offload_drops
    result.preemptions = stats.preemptions
    result.swap_preemptions = stats.swap_preemptions
    result.recompute_preemptions = stats.recompute_preemptions
    result.peak_kv_bytes = stats.peak_kv_bytes_used
    result.peak_offloaded_bytes = max((s.host_bytes for s in result.timeline), default=0)
