"""Random add/step/abort streams against tiny pools: integrity after every step, no lost pages, same outputs."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from engine_helpers import TINY_VOCAB, tiny_llm
from swarmkv import SamplingParams

BLOCK = 4

# A request: a head chosen from a few shared ones, a private tail, a generation length, a salt.
request = st.tuples(
    st.integers(0, 2),
    st.lists(st.integers(0, TINY_VOCAB - 1), min_size=1, max_size=24),
    st.integers(1, 16),
    st.sampled_from([None, "a"]),
)
add = st.tuples(st.just("add"), request)
action = st.one_of(
    add,
    add,
    add,
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
)
HEADS = [[(7 * i + h * 31) % TINY_VOCAB for i in range(n)] for h, n in enumerate((13, 21, 6))]


def run(
    actions: list, kv_pages: int, budget: int, prefix_caching: bool = True
) -> tuple[dict[str, list[int]], set[str], object]:
    llm = tiny_llm(
        kv_cache_memory=kv_pages
        * BLOCK
        * 2
        * 2
        * 2
        * 16
        * 8,  # pages x tokens x (K,V) x layers x heads x dim x f64
        block_size=BLOCK,
        max_num_batched_tokens=budget,
        max_model_len=min(64, kv_pages * BLOCK),
        prefix_caching=prefix_caching,
        check_writes=True,
    )
    engine = llm.engine
    outputs: dict[str, list[int]] = {}
    aborted: set[str] = set()
    ids: list[str] = []
    for kind, arg in actions:
        if kind == "add":
            head, tail, max_tokens, salt = arg
            rid = f"r{len(ids)}"
            ids.append(rid)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            engine.add_request(rid, HEADS[head] + tail, params, cache_salt=salt)
            outputs[rid] = []
        elif kind == "abort" and ids:
            rid = ids[arg % len(ids)]
            if engine.abort(rid):
                aborted.add(rid)
        else:
            for _ in range(arg):
                for delta in engine.step():
                    outputs[delta.request_id] += delta.new_token_ids
                engine.check_integrity()
    while engine.has_unfinished():
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
        engine.check_integrity()
    return outputs, aborted, engine


@pytest.mark.slow  # 40 examples of a few hundred engine steps: about 20 s
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=st.lists(action, min_size=8, max_size=25), kv_pages=st.integers(16, 24), budget=st.integers(8, 64)
)
def test_tiny_pool_streams_keep_integrity_and_outputs(actions: list, kv_pages: int, budget: int) -> None:
    small, aborted, engine = run(actions, kv_pages, budget)
    preemptions = engine.counters.preemptions  # type: ignore[attr-defined]
    target(float(preemptions), label="preemptions")
    event("preempted" if preemptions else "no preemption")
    kv = engine.core.kv  # type: ignore[attr-defined]
    assert kv.num_in_use == 0, "pages still held after every request finished"
    assert kv.num_free + kv.num_cached == kv.num_pages
    # Without aborts (which depend on timing) the same requests without sharing, in a roomy pool, generate
    # the same tokens: the reference shares no page, so a fault in sharing cannot hide in both runs.
    replay = [a for a in actions if a[0] != "abort"]
    large, _, big_engine = run(replay, 4096, 4096, prefix_caching=False)
    assert big_engine.counters.preemptions == 0  # type: ignore[attr-defined]
    for rid, tokens in small.items():
        if rid not in aborted:
            assert tokens == large[rid], f"{rid} differs between a tiny and a roomy pool"


def test_preemption_and_eviction_keep_outputs() -> None:
    """A fixed stream that must preempt and evict: same tokens as in a roomy pool."""
    actions = [
        ("add", (1, list(range(14)), 12, None)),
        ("add", (1, list(range(20, 34)), 12, None)),
        ("step", 2),
        ("add", (2, list(range(40, 60)), 12, "a")),
        ("add", (0, list(range(60, 80)), 12, None)),
    ]
    small, _, engine = run(actions, 17, 40)
    assert engine.counters.preemptions > 0  # type: ignore[attr-defined]
    assert engine.core.kv.num_evictions > 0  # type: ignore[attr-defined]
    large, _, _ = run(actions, 4096, 4096, prefix_caching=False)
    assert small == large
