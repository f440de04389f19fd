"""A step's length capped by time (`ServerConfig.max_step_s`, `Scheduler.cap_step_time`): an abort applies
between steps, so a server caps each step's tokens to what the measured prefill speed computes in that time,
and a client that goes away mid-prompt costs at most one short step (issue 53: cut streams freed within about
a second). Asserted by the chunks planned and the tokens computed, never by a clock."""

from __future__ import annotations

import pytest

from engine_helpers import tiny_llm
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.scheduler import PreemptionCost, Scheduler, SchedulerLimits
from swarmkv.core.sequence import Sequence
from swarmkv.core.stats import EngineCounters
from swarmkv.kv import KVCacheManager
from swarmkv.server import ServerConfig, create_app

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PAGE = 16


def scheduler(prefill_s_per_token: float, budget: int = 2048) -> Scheduler:
    cost = PreemptionCost(page_bytes=1, copy_bytes_per_s=1e9, prefill_s_per_token=prefill_s_per_token)
    return Scheduler(KVCacheManager(512, PAGE), SchedulerLimits(8, budget), EngineCounters(), cost)


def prefill_chunks(s: Scheduler, prompt_tokens: int, request_id: str = "long") -> list[int]:
    """The prefill chunk sizes a prompt of `prompt_tokens` is computed in, alone in the queue."""
    s.add(Sequence(request_id, [t % 90 + 1 for t in range(prompt_tokens)], PARAMS))
    sizes = []
    while True:
        chunks = [c for c in s.schedule().chunks if c.kind == "prefill"]
        if not chunks:
            return sizes
        s.commit(chunks)
        for chunk in chunks:
            sizes.append(chunk.num_tokens)
            if chunk.samples:
                chunk.seq.append_token(7)


def test_without_a_cap_a_prompt_takes_the_whole_token_budget() -> None:
    assert prefill_chunks(scheduler(0.01), 3000) == [2048, 952]


def test_a_cap_sizes_each_step_by_the_measured_prefill_speed() -> None:
    s = scheduler(0.01)  # 10 ms a token: 100 tokens a second
    s.cap_step_time(1.0)
    assert s.step_budget() == 100
    assert prefill_chunks(s, 1000) == [100] * 10
    s.cost.prefill_s_per_token = 0.001  # faster: the budget grows with the speed, up to the token budget
    assert s.step_budget() == 1000
    s.cost.prefill_s_per_token = 1e-6
    assert s.step_budget() == 2048


def test_a_cap_never_stops_a_prefill_moving() -> None:
    s = scheduler(10.0)  # a page's tokens take longer than the cap: still a page a step
    s.cap_step_time(1.0)
    assert prefill_chunks(s, 100) == [PAGE] * 6 + [4]


def test_decodes_count_against_the_capped_budget() -> None:
    s = scheduler(0.01)
    s.cap_step_time(0.5)  # 50 tokens a step
    assert prefill_chunks(s, 3, "short") == [3]  # it decodes from now on
    s.add(Sequence("long", [t % 90 + 1 for t in range(500)], PARAMS))
    chunks = s.schedule().chunks
    assert [(c.request_id, c.kind, c.num_tokens) for c in chunks] == [
        ("short", "decode", 1),
        ("long", "prefill", 49),
    ]


def test_the_server_caps_its_engines_steps_as_configured() -> None:
    llm = tiny_llm()
    scheduler = llm.engine.core.scheduler
    assert scheduler.limits.max_step_s is None  # the engine alone: its token budget
    create_app(llm, ServerConfig(max_step_s=0.5))
    assert scheduler.limits.max_step_s == 0.5
    create_app(llm, ServerConfig(max_step_s=0))
    assert scheduler.limits.max_step_s is None
    with pytest.raises(ValueError, match="max-step-s"):
        ServerConfig(max_step_s=-1)


def test_an_abort_after_a_capped_step_leaves_the_rest_of_the_prompt_uncomputed() -> None:
    llm = tiny_llm()
    engine = llm.engine
    engine.core.scheduler.cap_step_time(1.0)
    engine.preemption_cost.prefill_s_per_token = 1 / 64  # as if measured: 64 tokens a second
    engine.add_request("long", [t % 90 + 1 for t in range(1000)], PARAMS)
    engine.step()
    computed = engine.snapshot().prefill_tokens_computed
    assert computed == 64  # the rest of the prompt waits for later steps
    assert engine.abort("long")
    engine.step()
    assert engine.snapshot().prefill_tokens_computed == computed
    assert not engine.has_unfinished()
