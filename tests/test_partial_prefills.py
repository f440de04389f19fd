"""`max_num_partial_prefills`: how many requests one step prefills, shortest first, decodes untouched."""

from __future__ import annotations

import pytest

from swarmkv.core.config import EngineConfig
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.scheduler import Scheduler, SchedulerLimits
from swarmkv.core.sequence import Sequence
from swarmkv.core.stats import EngineCounters
from swarmkv.kv import KVCacheManager

PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def prefilled(plan_chunks: list) -> dict[str, int]:
    return {c.request_id: c.num_tokens for c in plan_chunks if c.kind == "prefill"}


def step(s: Scheduler) -> list:
    """Schedule and commit one step as the engine would (a sampled token after each finished prefill)."""
    chunks = s.schedule().chunks
    s.commit(chunks)
    for chunk in chunks:
        if chunk.samples:
            chunk.seq.append_token(7)
    return chunks


def scheduler(limit: int | None, budget: int = 4096) -> Scheduler:
    return Scheduler(
        KVCacheManager(256, 16), SchedulerLimits(8, budget, max_num_partial_prefills=limit), EngineCounters()
    )


def queue(s: Scheduler, lengths: dict[str, int]) -> None:
    for i, (rid, n) in enumerate(lengths.items()):
        s.add(Sequence(rid, [100 * i + t % 90 + 1 for t in range(n)], PARAMS))


def test_without_a_limit_every_prefill_that_fits_runs_in_one_step() -> None:
    s = scheduler(None)
    queue(s, {"a": 40, "b": 30, "c": 50})
    assert prefilled(step(s)) == {"a": 40, "b": 30, "c": 50}


def test_a_limit_takes_the_shortest_first_and_the_rest_next_steps() -> None:
    s = scheduler(2)
    queue(s, {"a": 40, "b": 30, "c": 50, "d": 20})
    assert prefilled(step(s)) == {"d": 20, "b": 30}
    second = step(s)
    assert prefilled(second) == {"a": 40, "c": 50}
    assert {c.request_id for c in second if c.kind == "decode"} == {"d", "b"}  # decodes are never held back


def test_a_running_chunked_prefill_counts_against_the_limit() -> None:
    s = scheduler(1, budget=32)
    queue(s, {"long": 80, "short": 40})
    assert prefilled(step(s)) == {"short": 32}  # shortest first, chunked by the budget
    assert prefilled(step(s)) == {"short": 8}  # its rest; "long" waits, one prefill a step
    third = step(s)
    assert prefilled(third) == {"long": 31} and [c.request_id for c in third if c.kind == "decode"] == [
        "short"
    ]


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_a_bad_limit_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="max_num_partial_prefills"):
        EngineConfig(max_num_partial_prefills=value)  # type: ignore[arg-type]
