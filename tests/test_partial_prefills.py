"""`max_num_partial_prefills`: how many requests one step prefills, shortest first, decodes untouched."""

from __future__ import annotations

import argparse
import random

import pytest

from engine_helpers import tiny_llm
from swarmkv.core.config import EngineConfig
from swarmkv.core.core import EngineCore
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.scheduler import Scheduler, SchedulerLimits
from swarmkv.core.sequence import Sequence
from swarmkv.core.stats import EngineCounters
from swarmkv.kv import KVCacheManager
from swarmkv.options import add_engine_arguments, engine_kwargs

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
    queue(s, {"long": 80, "short": 60})
    assert prefilled(step(s)) == {"short": 32}  # shortest first, chunked by the budget
    assert prefilled(step(s)) == {"short": 28}  # its rest; "long" waits, one prefill a step
    third = step(s)
    assert prefilled(third) == {"long": 31} and [c.request_id for c in third if c.kind == "decode"] == [
        "short"
    ]


def test_followers_of_an_in_flight_head_take_no_place() -> None:
    """A cold swarm under a limit of 1: the head is computed once, then every follower is admitted at once
    with its own tail (more than a page), beside the one prefill the limit allows."""
    s = scheduler(1)
    head = [1000 + t for t in range(64)]  # four full pages
    for i in range(4):
        s.add(Sequence(f"f{i}", head + [2000 + 100 * i + t for t in range(40)], PARAMS))
    queue(s, {"other": 30})  # its own prompt: it needs a place
    assert prefilled(step(s)) == {"other": 30}  # the shortest; the swarm's head waits its turn
    assert prefilled(step(s)) == {"f0": 104}  # the head, once: the others wait for it, taking no place
    assert all(seq.waited_for_prefix for seq in s.waiting)
    assert prefilled(step(s)) == {"f1": 40, "f2": 40, "f3": 40}  # all read the head, none held back
    assert s.counters.prefix_hit_tokens == 3 * 64
    s.check_integrity()


def test_a_follower_found_while_the_limit_is_full_is_one() -> None:
    """The head's first chunk takes the one place; the others, passed over for the limit, are still marked
    followers of it, so they are admitted together with the head's last chunk once it is cached."""
    s = scheduler(1, budget=80)
    head = [1000 + t for t in range(80)]  # five full pages: the head's first chunk
    for i in range(4):
        s.add(Sequence(f"f{i}", head + [2000 + 100 * i + t for t in range(20)], PARAMS))
    assert prefilled(step(s)) == {"f0": 80}
    assert [seq.waited_for_prefix for seq in s.waiting] == [True] * 3
    assert prefilled(step(s)) == {"f0": 20, "f1": 20, "f2": 20, "f3": 20}
    s.check_integrity()


def test_a_prefill_with_at_most_a_page_left_takes_no_place() -> None:
    s = scheduler(1)
    prompt = [1000 + t for t in range(100)]
    s.add(Sequence("first", prompt, PARAMS))
    step(s)
    s.finish(s.running[0], "stop")  # its KV stays cached
    s.add(Sequence("again", prompt + [5, 6, 7, 8], PARAMS))  # the same prompt and a short tail
    queue(s, {"p": 40, "q": 50, "tiny": 9})
    chunks = prefilled(step(s))
    assert chunks.keys() == {"again", "tiny", "p"}  # the one place goes to p, the shortest that needs one
    assert chunks["again"] <= 16 and chunks["tiny"] == 9 and chunks["p"] == 40


def test_a_budget_cut_chunk_of_a_long_prompt_takes_a_place() -> None:
    s = scheduler(1, budget=44)
    queue(s, {"a": 40, "b": 80})
    assert prefilled(step(s)) == {"a": 40}  # b's 4 tokens would fit the budget, not the limit


def test_the_limit_holds_on_every_step_and_decodes_always_run() -> None:
    rng = random.Random(4)
    s = scheduler(2, budget=128)
    queue(s, {f"r{i}": rng.randrange(5, 200) for i in range(12)})
    while s.has_work():
        decoding = {
            seq.request_id for seq in s.running if seq.num_uncomputed_tokens == 1 and seq.output_token_ids
        }
        chunks = step(s)
        assert sum(c.kind == "prefill" and c.num_tokens > 16 for c in chunks) <= 2
        assert decoding <= {c.request_id for c in chunks if c.kind == "decode"}
        for seq in list(s.running):
            if len(seq.output_token_ids) >= PARAMS.max_tokens:
                s.finish(seq, "length")
        s.check_integrity()


def test_auto_is_two_on_the_cpu_and_no_limit_elsewhere() -> None:
    auto = EngineConfig()
    assert auto.max_num_partial_prefills == "auto"
    assert auto.partial_prefill_limit("cpu") == 2 and auto.partial_prefill_limit("cuda") is None
    for off in (0, None):
        assert EngineConfig(max_num_partial_prefills=off).partial_prefill_limit("cpu") is None
    assert EngineConfig(max_num_partial_prefills=3).partial_prefill_limit("cuda") == 3
    assert EngineCore(auto, 64).scheduler.limits.max_num_partial_prefills == 2
    assert EngineCore(auto, 64, device_type="cuda").scheduler.limits.max_num_partial_prefills is None
    assert (
        tiny_llm().engine.core.scheduler.limits.max_num_partial_prefills == 2
    )  # the engine passes its device


def test_the_flag_takes_auto_or_a_number() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert parser.parse_args([]).max_num_partial_prefills == "auto"
    for given, value in (("auto", "auto"), ("0", 0), ("3", 3)):
        args = parser.parse_args(["--max-num-partial-prefills", given])
        assert engine_kwargs(args)["max_num_partial_prefills"] == value
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-partial-prefills", "many"])


@pytest.mark.parametrize("value", [-1, 1.5, True, "off"])
def test_a_bad_limit_is_refused(value: object) -> None:
    with pytest.raises(ValueError, match="max_num_partial_prefills"):
        EngineConfig(max_num_partial_prefills=value)  # type: ignore[arg-type]
