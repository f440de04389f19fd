"""Sessions, retention, the host tier, swap and pins through the engine on a tiny model: greedy outputs never
change, and the counters say what each policy saved."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine_helpers import tiny_llm
from swarmkv import LLM
from swarmkv.core.config import EngineConfig
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.errors import InvalidRequestError, PinLimitError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
POLICIES: dict[str, dict[str, Any]] = {
    "lru": {"retention": "lru"},
    "session": {"retention": "session"},
    "return": {"retention": "return"},
    "session+offload": {"retention": "session", "offload_memory": "8MiB"},
}


def checked(llm: LLM) -> LLM:
    """Check the engine's books after every step."""
    step = llm.engine.step

    def checked_step() -> Any:
        deltas = step()
        llm.engine.check_integrity()
        return deltas

    llm.engine.step = checked_step  # type: ignore[method-assign]
    return llm


def agents_run(llm: LLM, num_agents: int = 4, turns: int = 6, seed: int = 0) -> list[list[int]]:
    """Agents sharing a head take turns out of lockstep, each turn adding a tool result of random size."""
    rng = random.Random(seed)
    head = [rng.randrange(256) for _ in range(48)]
    contexts = [head + [rng.randrange(256) for _ in range(8)] for _ in range(num_agents)]
    generated: list[list[int]] = [[] for _ in range(num_agents)]
    for _ in range(turns):
        order = list(range(num_agents))
        rng.shuffle(order)
        batch = order[: rng.randrange(1, num_agents + 1)]  # some agents are still on their tool call
        outs = llm.generate([contexts[a] for a in batch], GREEDY, session_id=[f"agent-{a}" for a in batch])
        for a, out in zip(batch, outs, strict=True):
            assert out.error is None
            generated[a] += out.token_ids
            contexts[a] = (
                contexts[a] + out.token_ids + [rng.randrange(256) for _ in range(rng.randrange(4, 40))]
            )
    for a in range(num_agents):
        llm.release_session(f"agent-{a}")
    return generated


@pytest.fixture(scope="module")
def runs() -> dict[str, tuple[list[list[int]], dict[str, Any]]]:
    results = {}
    for name, options in POLICIES.items():
        llm = checked(tiny_llm(kv_cache_memory="160KiB", block_size=4, **options))
        results[name] = (agents_run(llm), llm.stats())
    return results


def test_policies_generate_the_same_tokens(runs: dict[str, Any]) -> None:
    reference = runs["lru"][0]
    alone = agents_run(tiny_llm(block_size=4))  # a pool that never evicts
    assert alone == reference
    for name, (generated, _) in runs.items():
        assert generated == reference, f"{name} changed the greedy outputs"


def test_sessions_recompute_less_and_offload_least(runs: dict[str, Any]) -> None:
    lru, session, offload = (runs[name][1] for name in ("lru", "session", "session+offload"))
    assert lru["evictions"] > 0 and lru["recomputed_tokens"] > 0, "the pool should be under pressure"
    assert session["recomputed_tokens"] <= lru["recomputed_tokens"]
    assert offload["recomputed_tokens"] <= 0.1 * lru["recomputed_tokens"]
    assert (
        offload["offload_loads"] > 0 and offload["offload_load_bytes"] > 0 and offload["offload_stores"] > 0
    )


def test_token_books_balance_for_sessions(runs: dict[str, Any]) -> None:
    for _, stats in runs.values():
        assert stats["prefill_tokens_computed"] == (
            stats["prompt_tokens"] - stats["prefix_hit_tokens"] + stats["recomputed_tokens"]
        )
        assert stats["kv_pages_in_use"] == 0 and stats["sessions_open"] == 0


def test_preemption_swaps_private_pages_when_the_host_has_room() -> None:
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(40)] for _ in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    alone = [out.token_ids for out in tiny_llm(block_size=4).generate(prompts, params)]
    swapped = checked(tiny_llm(kv_cache_memory="96KiB", block_size=4, offload_memory="8MiB"))
    assert [out.token_ids for out in swapped.generate(prompts, params)] == alone
    stats = swapped.stats()
    assert stats["preemptions"] > 0 and stats["swap_preemptions"] > 0
    assert stats["swap_preemptions"] + stats["recompute_preemptions"] == stats["preemptions"]
    recomputing = checked(tiny_llm(kv_cache_memory="96KiB", block_size=4))
    assert [out.token_ids for out in recomputing.generate(prompts, params)] == alone
    assert recomputing.stats()["recompute_preemptions"] == recomputing.stats()["preemptions"] > 0
    assert stats["recomputed_tokens"] < recomputing.stats()["recomputed_tokens"]


def test_a_short_prefill_runs_before_a_long_cold_prompt() -> None:
    llm = tiny_llm(block_size=4, max_num_batched_tokens=32)
    engine = llm.engine
    engine.add_request("cold", list(range(200)), GREEDY)
    engine.step()  # the cold prompt is chunked: 32 of its 200 tokens
    engine.add_request("short", list(range(300, 320)), GREEDY)
    engine.step()
    short = engine.get_sequence("short")
    assert short is not None and short.num_computed_tokens == 20, "the short prefill should run whole first"
    cold = engine.get_sequence("cold")
    assert cold is not None and cold.num_computed_tokens == 32 + 12, "the cold prompt takes what is left"


def test_decodes_come_before_prefills() -> None:
    llm = tiny_llm(block_size=4, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("decoder", list(range(10)), GREEDY)
    engine.step()
    engine.add_request("cold", list(range(100, 200)), GREEDY)
    engine.step()
    decoder = engine.get_sequence("decoder")
    assert decoder is not None and len(decoder.output_token_ids) == 2


def test_a_pin_survives_pressure_until_unpinned() -> None:
    llm = checked(tiny_llm(kv_cache_memory="96KiB", block_size=4))  # 24 pages, half of them pinnable
    head = list(range(1, 41))
    pin = llm.pin(head, ttl_s=600)
    assert pin.ready and pin.num_tokens == 40 and pin.kv_bytes == 10 * llm.engine.page_bytes
    rng = random.Random(1)
    llm.generate([[rng.randrange(256) for _ in range(50)] for _ in range(8)], GREEDY)
    assert llm.engine.core.kv.lookup(head, None).num_tokens == 40, "pinned pages should never be evicted"
    assert llm.stats()["pinned_bytes"] == pin.kv_bytes and llm.stats()["pins"] == 1
    assert llm.unpin(pin.pin_id) and not llm.unpin(pin.pin_id)
    assert llm.stats()["pinned_bytes"] == 0 and llm.stats()["kv_pages_in_use"] == 0


def test_a_pin_expires_after_its_ttl() -> None:
    llm = tiny_llm(block_size=4)
    now = [100.0]
    llm.engine.core.pins._clock = lambda: now[0]
    pin = llm.pin(list(range(1, 21)), ttl_s=5)
    assert llm.engine.get_pin(pin.pin_id) is not None
    now[0] += 5.1
    assert llm.engine.get_pin(pin.pin_id) is None and llm.stats()["pinned_bytes"] == 0


@pytest.mark.parametrize("ttl", [-1, 0, float("nan"), float("inf"), "soon", True])
def test_a_bad_ttl_is_refused_and_nothing_runs(ttl: Any) -> None:
    llm = tiny_llm(block_size=4)
    with pytest.raises(InvalidRequestError, match="ttl_s"):
        llm.engine.add_pin("p", [1, 2, 3], ttl)
    assert not llm.engine.has_unfinished() and llm.stats()["pins"] == 0


def test_pins_past_the_cap_are_refused() -> None:
    llm = tiny_llm(block_size=4, kv_cache_memory="64KiB", max_pinned_memory="32KiB")
    page = llm.engine.page_bytes
    assert 32 * 1024 // page == 8
    llm.pin(list(range(1, 25)), ttl_s=60)  # 6 pages
    with pytest.raises(PinLimitError, match="max_pinned_memory"):
        llm.pin(list(range(100, 120)), ttl_s=60)  # 5 more
    assert llm.stats()["pinned_bytes"] == 6 * page
    llm.generate([[5, 6, 7]], GREEDY)  # the engine keeps serving


def test_bad_session_ids_are_refused() -> None:
    llm = tiny_llm(block_size=4)
    for bad in ("", "x" * 257, 7):
        with pytest.raises(InvalidRequestError, match="session id"):
            llm.engine.add_request("r", [1, 2], GREEDY, session_id=bad)  # type: ignore[arg-type]
    assert not llm.engine.has_unfinished()
    assert not llm.release_session("never-seen")


def test_past_the_open_session_cap_the_longest_idle_session_is_released() -> None:
    llm = tiny_llm(block_size=4, max_open_sessions=2)
    for session in ("a", "b", "a", "c"):
        llm.generate([[1, 2, 3, 4, 5]], GREEDY, session_id=session)
    assert llm.stats()["sessions_open"] == 2
    assert not llm.release_session("b"), "b idled longest and was released"
    assert llm.release_session("a") and llm.release_session("c")


def test_a_pin_shorter_than_a_page_is_refused() -> None:
    llm = tiny_llm(block_size=4)
    with pytest.raises(InvalidRequestError, match="whole pages"):
        llm.engine.add_pin("p", [1, 2, 3], 60)
    assert not llm.engine.has_unfinished()


def test_pinned_pages_count_against_the_prompts_the_pool_accepts() -> None:
    llm = tiny_llm(block_size=4, kv_cache_memory="64KiB")  # 16 pages of 4 tokens
    llm.pin(list(range(1, 29)), ttl_s=60)  # 7 pages
    with pytest.raises(InvalidRequestError, match="besides pinned pages"):
        llm.engine.add_request("big", list(range(40)), GREEDY)
    with pytest.raises(ValueError, match="max_pinned_memory"):
        tiny_llm(kv_cache_memory="64KiB", max_pinned_memory="64KiB")


def test_a_long_prefill_passed_over_by_short_ones_is_not_starved() -> None:
    llm = tiny_llm(block_size=4, max_num_batched_tokens=32)
    engine = llm.engine
    engine.add_request("cold", list(range(200)), GREEDY)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for step in range(3 * engine.config.starvation_steps):
        for k in range(2):  # two 16-token turns a step take the whole budget, shortest first
            engine.add_request(f"short-{step}-{k}", [300 + step, 301 + k, *range(14)], one)
        engine.step()
        engine.check_integrity()
    cold = engine.get_sequence("cold")
    assert cold is not None and cold.num_computed_tokens >= 2 * 32, "the cold prompt should still progress"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"retention": "fifo"}, "retention"),
        ({"offload_memory": "lots"}, "size"),
        ({"max_pinned_memory": "2GiB"}, "max_pinned_memory"),
    ],
)
def test_bad_session_options_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(kv_cache_memory="1GiB", **options)


def test_a_pin_counts_under_its_own_counters_not_as_prompt_tokens() -> None:
    llm = tiny_llm(block_size=4)
    head = list(range(1, 41))
    pin = llm.pin(head, ttl_s=600)
    assert pin.num_cached_tokens == 0 and pin.num_created_tokens == 40
    stats = llm.stats()
    assert stats["prompt_tokens"] == stats["prefix_hit_tokens"] == stats["prefill_tokens_computed"] == 0
    assert stats["generated_tokens"] == 0  # the pin's one token is dropped
    assert stats["pin_prompt_tokens"] == stats["pin_prefill_tokens_computed"] == 40
    # A request reading the pinned head counts it as its own hit; the identity holds for requests alone.
    (out,) = llm.generate([[*head, 50, 51]], GREEDY)
    assert out.num_cached_tokens == 40
    stats = llm.stats()
    assert (stats["prompt_tokens"], stats["prefix_hit_tokens"]) == (42, 40)
    assert stats["prefill_tokens_computed"] == (
        stats["prompt_tokens"] - stats["prefix_hit_tokens"] + stats["recomputed_tokens"]
    )
    again = llm.pin(head[:20], ttl_s=600)  # cached already: the pin reads it and creates nothing
    assert (again.num_cached_tokens, again.num_created_tokens) == (20, 0)
    stats = llm.stats()
    # Its last token is computed again for its logits, as any prefill's is.
    assert stats["pin_prefix_hit_tokens"] == 19 and stats["pin_prompt_tokens"] == 60
    assert stats["prompt_tokens"] == 42
