"""Prefix sharing changes what is stored and computed, never what is generated."""

from __future__ import annotations

import random

import pytest

from engine_helpers import TINY_VOCAB, tiny_llm
from swarmkv import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def swarm_prompts(prefix_len: int, tail_lens: list[int], seed: int = 0) -> list[list[int]]:
    """Prompts sharing one `prefix_len`-token head, each with its own tail."""
    rng = random.Random(seed)
    head = [rng.randrange(TINY_VOCAB) for _ in range(prefix_len)]
    return [head + [rng.randrange(TINY_VOCAB) for _ in range(n)] for n in tail_lens]


PROMPTS = swarm_prompts(1037, [5, 40, 17, 64, 1, 33, 90, 12])


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Greedy outputs with no sharing, all prompts at once, one big chunk budget."""
    llm = tiny_llm(prefix_caching=False, max_num_batched_tokens=8192)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("chunk", [64, 250, 2048])
@pytest.mark.parametrize("order", ["forward", "reversed", "shuffled"])
def test_sharing_is_token_identical(reference: list[list[int]], chunk: int, order: str) -> None:
    indices = list(range(len(PROMPTS)))
    if order == "reversed":
        indices.reverse()
    elif order == "shuffled":
        random.Random(7).shuffle(indices)
    llm = tiny_llm(prefix_caching=True, max_num_batched_tokens=chunk)
    outs = llm.generate([PROMPTS[i] for i in indices], GREEDY)
    for i, out in zip(indices, outs, strict=True):
        assert out.token_ids == reference[i], f"prompt {i} diverged with chunk={chunk}, order={order}"
    assert llm.stats()["prefix_hit_tokens"] > 0
    llm.engine.check_integrity()


def test_no_sharing_chunked_matches_unchunked(reference: list[list[int]]) -> None:
    llm = tiny_llm(prefix_caching=False, max_num_batched_tokens=100)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_cold_swarm_computes_the_shared_head_once() -> None:
    block = 16
    prefix, tail, n = 1000, 24, 8
    prompts = swarm_prompts(prefix, [tail] * n, seed=3)
    llm = tiny_llm(block_size=block, max_num_batched_tokens=512)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    bpt = engine.kv_bytes_per_token
    page = engine.page_bytes
    checked = False
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        live = engine.core.scheduler.running
        if not checked and len(live) == n and all(s.output_token_ids for s in live):
            stats = llm.stats()
            decoded = sum(len(s.output_token_ids) - 1 for s in live)  # KV written by decode steps so far
            expected = (prefix + n * tail + decoded) * bpt
            assert abs(stats["kv_bytes_in_use"] - expected) <= n * page
            assert abs(stats["kv_bytes_logical"] - (n * (prefix + tail) + decoded) * bpt) <= n * page
            checked = True
    assert checked, "the 8 requests were never live together"
    stats = llm.stats()
    assert stats["prefill_tokens_computed"] <= prefix + n * tail + n * block
    assert stats["prefix_hit_tokens"] >= (n - 1) * (prefix // block * block)
    assert stats["kv_pages_in_use"] == 0


def test_cache_salt_isolates_tenants() -> None:
    prompts = swarm_prompts(200, [10, 10], seed=5)
    llm = tiny_llm()
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    a, b = llm.generate(prompts, params, cache_salt=["tenant-a", "tenant-b"])
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    (c,) = llm.generate([prompts[1]], params, cache_salt="tenant-a")
    assert c.num_cached_tokens >= 192  # same salt: tenant a's pages are shared
    assert c.token_ids == b.token_ids


def test_second_turn_only_prefills_the_new_tokens() -> None:
    (first,) = swarm_prompts(300, [20], seed=9)
    llm = tiny_llm()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    (turn1,) = llm.generate([first], params)
    before = llm.stats()["prefill_tokens_computed"]
    second = first + turn1.token_ids + list(range(50, 90))  # the tool result
    (turn2,) = llm.generate([second], params)
    computed = llm.stats()["prefill_tokens_computed"] - before
    # Every token whose KV the first turn computed is reused, the partly filled last page included: only
    # the reply's last token (sampled, never run through the model) and the tool result are prefilled.
    assert turn2.num_cached_tokens == len(first) + len(turn1.token_ids) - 1
    assert computed == 1 + 40
    # The reused KV is right: a run that shares nothing generates the same tokens from the same prompt.
    (solo,) = tiny_llm(prefix_caching=False).generate([second], params)
    assert turn2.token_ids == solo.token_ids


@pytest.mark.parametrize("limit", [0, "auto"])
def test_without_sharing_waiting_requests_do_not_wait_for_each_other(limit: int | str) -> None:
    llm = tiny_llm(prefix_caching=False, max_num_batched_tokens=8192, max_num_partial_prefills=limit)
    engine = llm.engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    # There is nothing to hit, so no reason to wait for another's prefill: without a limit all are admitted at
    # once, and under the CPU's limit of 2 the others wait for it alone, none as a follower.
    assert len(engine.core.scheduler.running) == (len(PROMPTS) if limit == 0 else 2)
    assert not any(seq.waited_for_prefix for seq in engine.core.scheduler.waiting)
