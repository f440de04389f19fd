"""Run a swarm workload on the in-process engine, in one KV layout, and measure what it costs."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from swarmkv.core.config import EngineConfig
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.engine.engine import LLMEngine
from swarmkv.models.loader import LoadedModel
from swarmkv.swarm.workload import Message, Workload, initial_messages, tool_result_message

Mode = Literal["shared", "per-slot"]
MODES: tuple[Mode, ...] = ("shared", "per-slot")


@dataclass
class ModeResult:
    """What one layout measured; bytes are KV bytes, times are seconds."""

    mode: Mode
    peak_kv_bytes: int = 0
    final_kv_bytes: int = 0
    prompt_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefix_hit_tokens: int = 0
    recomputed_tokens: int = 0
    generated_tokens: int = 0
    decode_tokens: int = 0  # tokens sampled in decode-only steps
    cascade_decode_rows: int = 0
    wall_s: float = 0.0
    decode_s: float = 0.0  # time of decode-only steps
    ttft_s: list[list[float]] = field(default_factory=list)  # [agent][turn]
    kv_bytes_timeline: list[int] = field(default_factory=list)  # pages not free, after each step
    agent_tokens: list[int] = field(default_factory=list)  # each agent's context length at the end
    pool_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of prompt tokens served from the prefix cache."""
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens sampled in decode-only steps per second of those steps."""
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


ProgressFn = Callable[[int, int, ModeResult], None]


def pool_bytes_for(workload: Workload, prompt_tokens_per_agent: int, kv_bytes_per_token: int) -> int:
    """A pool that holds every agent's full context privately, with room to spare: nothing gets evicted."""
    per_agent = prompt_tokens_per_agent + workload.turns * (workload.max_tokens + 600)
    return 2 * len(workload.agents) * per_agent * kv_bytes_per_token


def swarm_engine(loaded: LoadedModel, workload: Workload, config: EngineConfig) -> LLMEngine:
    """An engine for this swarm: `config` with one running request per agent and the prefix index on."""
    # Both layouts index pages: per-slot files each agent's pages under its own salt, so an agent reuses its
    # own earlier turns but never another agent's pages.
    return LLMEngine(
        loaded, dataclasses.replace(config, max_num_seqs=len(workload.agents), prefix_caching=True)
    )


def warm_up(loaded: LoadedModel, workload: Workload, config: EngineConfig) -> None:
    """Run one short request on an engine like the timed ones, before any mode is timed."""
    # First-run costs (the allocator's first pool, kernel compilation, CUDA start-up) would otherwise
    # be charged to whichever mode runs first.
    engine = swarm_engine(loaded, workload, config)
    ids = loaded.tokenizer.encode("Warm up: count to three.")
    engine.add_request("warm-up", ids, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def run_swarm(
    loaded: LoadedModel,
    workload: Workload,
    mode: Mode,
    config: EngineConfig,
    progress: ProgressFn | None = None,
) -> ModeResult:
    """Every agent runs its turns back to back; a finished turn's tool result is appended at once."""
    engine = swarm_engine(loaded, workload, config)
    tokenizer = loaded.tokenizer
    agents = workload.agents
    result = ModeResult(
        mode, ttft_s=[[] for _ in agents], pool_bytes=engine.core.kv.num_pages * engine.page_bytes
    )
    params = SamplingParams(max_tokens=workload.max_tokens, temperature=0.0)
    messages: list[list[Message]] = [initial_messages(workload, a) for a in agents]
    replies: dict[str, list[str]] = {}
    submitted: dict[str, float] = {}
    turn_of = [0] * len(agents)
    total_turns = len(agents) * workload.turns
    done_turns = 0

    def submit(i: int) -> None:
        text = tokenizer.apply_chat_template(messages[i], tools=list(workload.tools))
        ids = tokenizer.encode(text)
        rid = f"{agents[i].agent_id}/turn-{turn_of[i]}"
        salt = agents[i].agent_id if mode == "per-slot" else None
        engine.add_request(rid, ids, params, cache_salt=salt)
        submitted[rid] = time.perf_counter()
        replies[rid] = []

    start = time.perf_counter()
    for i in range(len(agents)):
        submit(i)
    index_of = {a.agent_id: i for i, a in enumerate(agents)}
    while engine.has_unfinished():
        prefill_before = engine.counters.prefill_tokens_computed
        step_start = time.perf_counter()
        deltas = engine.step()
        now = time.perf_counter()
        if engine.counters.prefill_tokens_computed == prefill_before:
            result.decode_s += now - step_start
            result.decode_tokens += sum(len(d.new_token_ids) for d in deltas)
        result.kv_bytes_timeline.append(engine.snapshot().kv_bytes_used)
        for delta in deltas:
            i = index_of[delta.request_id.split("/")[0]]
            if not replies[delta.request_id] and delta.new_token_ids:
                result.ttft_s[i].append(now - submitted[delta.request_id])
            replies[delta.request_id].append(delta.new_text)
            if not delta.finished:
                continue
            done_turns += 1
            messages[i].append({"role": "assistant", "content": "".join(replies[delta.request_id])})
            if turn_of[i] + 1 < workload.turns:
                messages[i].append(tool_result_message(agents[i], turn_of[i]))
                turn_of[i] += 1
                submit(i)
            if progress is not None:
                progress(done_turns, total_turns, result)
    result.wall_s = time.perf_counter() - start
    stats = engine.snapshot()
    result.peak_kv_bytes = stats.peak_kv_bytes_used
    result.final_kv_bytes = stats.kv_bytes_used
    result.prompt_tokens = stats.prompt_tokens
    result.prefill_tokens_computed = stats.prefill_tokens_computed
    result.prefix_hit_tokens = stats.prefix_hit_tokens
    result.recomputed_tokens = stats.recomputed_tokens
    result.generated_tokens = stats.generated_tokens
    result.cascade_decode_rows = stats.cascade_decode_rows
    result.agent_tokens = [
        len(tokenizer.encode(tokenizer.apply_chat_template(m, tools=list(workload.tools)))) for m in messages
    ]
    engine.check_integrity()
    return result
