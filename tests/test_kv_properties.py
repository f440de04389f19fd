"""Property tests of the KV manager, alone and behind the scheduler's admission path, without a model."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.scheduler import Scheduler, SchedulerLimits, StepPlan
from swarmkv.core.sequence import Sequence
from swarmkv.core.stats import EngineCounters
from swarmkv.kv import NO_HIT, KVCacheManager

PAGE = 2
tokens_st = st.lists(st.integers(0, 3), min_size=1, max_size=12)
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def snapshot(kv: KVCacheManager) -> Any:
    """Everything the manager's verbs may change."""
    index = kv.index
    return (
        list(kv.pool.refcounts),
        [kv.pool.is_free(p) for p in range(kv.num_pages)],
        sorted(p for p in range(kv.num_pages) if index.is_cached(p)),
        {rid: list(t.pages) for rid, t in kv._tables.items()},
        index.num_roots,
    )


def request(rid: str, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(rid, tokens, PARAMS, salt)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), tokens_st, st.sampled_from([None, "x"]), st.integers(0, 9), st.booleans()),
        max_size=40,
    ),
    num_pages=st.integers(1, 12),
    sharing=st.booleans(),
)
def test_manager_verbs_keep_the_books(ops: list, num_pages: int, sharing: bool) -> None:
    kv = KVCacheManager(num_pages, PAGE, prefix_caching=sharing)
    live: list[Sequence] = []
    for n, (add, tokens, salt, pick, keep_partial) in enumerate(ops):
        if add or not live:
            seq = request(f"r{n}", tokens, salt)
            before = snapshot(kv)
            hit = kv.lookup(tokens[: len(tokens) - 1], salt)
            assert snapshot(kv) == before, "lookup changed the manager"
            if not sharing:
                assert hit.num_tokens == 0
            pages = kv.allocate(seq, hit, len(tokens) - hit.num_tokens)
            if pages is None:
                assert snapshot(kv) == before, "a refused allocate changed the manager"
                continue
            assert list(kv.page_table(seq.request_id)) == pages
            assert len(pages) == -(-len(tokens) // PAGE)
            seq.num_computed_tokens = len(tokens)
            kv.commit(seq, len(tokens))
            assert list(kv.page_table(seq.request_id)) == pages, "commit rewrote a page table"
            live.append(seq)
        else:
            seq = live.pop(pick % len(live))
            kv.free(seq, keep_partial=keep_partial)
        kv.check_integrity()
    for seq in live:
        hit = kv.lookup(seq.token_ids, seq.cache_salt)
        # Every full page a live request indexed is findable again: it cannot have been evicted.
        table = kv._tables[seq.request_id]
        assert list(hit.pages[: len(table.path)]) == table.path
    for seq in live:
        kv.free(seq)
    kv.check_integrity()
    assert kv.num_in_use == 0
    kv.evict(num_pages)
    assert kv.num_free == num_pages


class FakeRunner:
    """Computes nothing: every sampled token is a function of the request's length, as a model's would be
    of its context, so replays are deterministic."""

    def step(self, scheduler: Scheduler) -> StepPlan:
        plan = scheduler.schedule()
        for chunk in plan.chunks:
            scheduler.kv.check_writable(chunk.request_id, chunk.start, chunk.start + chunk.num_tokens)
        scheduler.commit(plan.chunks)
        for chunk in plan.chunks:
            if chunk.samples:
                seq = chunk.seq
                seq.append_token(seq.num_tokens % 4)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    scheduler.finish(seq, "length")
        return plan


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["add", "add", "step", "abort"]), tokens_st, st.sampled_from([None, "x"])),
        max_size=40,
    ),
    num_pages=st.integers(4, 16),
    budget=st.integers(1, 16),
    sharing=st.booleans(),
)
def test_scheduler_admission_keeps_the_books(ops: list, num_pages: int, budget: int, sharing: bool) -> None:
    kv = KVCacheManager(num_pages, PAGE, prefix_caching=sharing)
    counters = EngineCounters()
    scheduler = Scheduler(kv, SchedulerLimits(4, budget), counters)
    runner = FakeRunner()
    tables: dict[str, list[int]] = {}
    live: list[Sequence] = []
    for n, (op, tokens, salt) in enumerate(ops):
        if op == "add":
            seq = request(f"r{n}", tokens, salt)
            scheduler.add(seq)
            live.append(seq)
        elif op == "abort" and live:
            scheduler.finish(live.pop(0), "abort")
        else:
            for rid in runner.step(scheduler).freed:  # freed, maybe readmitted: a new table
                tables.pop(rid, None)
        for seq in scheduler.running:  # page tables only ever grow while a request runs
            table = list(kv.page_table(seq.request_id))
            old = tables.get(seq.request_id, [])
            assert table[: len(old)] == old, "a page table entry was rewritten"
            tables[seq.request_id] = table
        for rid in [r for r in tables if not kv.holds_pages(r)]:
            del tables[rid]
        scheduler.check_integrity()
        c = counters
        assert c.prefill_tokens_computed == c.prompt_tokens - c.prefix_hit_tokens + c.recomputed_tokens
    while scheduler.has_work():
        runner.step(scheduler)
        scheduler.check_integrity()
    assert kv.num_in_use == 0


def test_shared_head_is_evicted_last() -> None:
    kv = KVCacheManager(8, PAGE)
    head = [1, 1, 2, 2]
    a, b = request("a", [*head, 3, 3]), request("b", [*head, 4, 4])
    for seq in (a, b):
        hit = kv.lookup(seq.token_ids, None)
        assert kv.allocate(seq, hit, 6 - hit.num_tokens) is not None
        seq.num_computed_tokens = 6
        kv.commit(seq, 6)
    assert kv.page_table("a")[:2] == kv.page_table("b")[:2]
    head_pages = list(kv.page_table("a")[:2])
    kv.free(a)
    kv.free(b)
    assert kv.evict(2) == 2 and kv.num_cached == 2  # the two private tails went first
    assert list(kv.lookup([*head, 9], None).pages) == head_pages, "the shared head should have survived"
    kv.check_integrity()


def test_salts_never_share() -> None:
    kv = KVCacheManager(8, PAGE)
    a = request("a", [1, 2, 3, 4, 5], "a")
    assert kv.allocate(a, NO_HIT, 5) is not None
    a.num_computed_tokens = 5
    kv.commit(a, 5)
    assert kv.lookup([1, 2, 3, 4, 5], "b").num_tokens == 0
    assert kv.lookup([1, 2, 3, 4, 5], None).num_tokens == 0
    assert list(kv.lookup([1, 2, 3, 4, 5], "a").pages) == list(kv.page_table("a")[:2])
    kv.check_integrity()


def test_a_page_computed_twice_stays_private_and_is_freed_with_its_request() -> None:
    kv = KVCacheManager(8, PAGE)
    first, second = request("a", [5, 6, 7, 8]), request("b", [5, 6, 7, 8, 9, 10])
    for seq in (first, second):  # a cold race: both miss, both compute the same two pages
        assert kv.allocate(seq, kv.lookup(seq.token_ids, None), seq.num_tokens) is not None
    for seq in (first, second):
        seq.num_computed_tokens = seq.num_tokens
        kv.commit(seq, seq.num_tokens)
    a_pages, b_pages = list(kv.page_table("a")), list(kv.page_table("b"))
    assert not set(a_pages) & set(b_pages), "append-only: the loser keeps its own pages"
    # The loser holds the index's copies too, and its third page is indexed under them.
    assert list(kv.lookup([5, 6, 7, 8, 9, 10, 0], None).pages) == [*a_pages, b_pages[2]]
    assert [kv.pool.refcounts[p] for p in a_pages] == [2, 2]
    kv.check_integrity()
    kv.free(second)
    assert kv.num_free == 5 and kv.num_in_use == 2, "the duplicates went straight back to the free list"
    kv.free(first)
    kv.check_integrity()


def test_a_page_aligned_cached_prompt_copies_its_last_page() -> None:
    copies: list[tuple[int, int]] = []
    kv = KVCacheManager(8, PAGE, copy_page=lambda src, dst: copies.append((src, dst)))
    first = request("a", [1, 2, 3, 4])
    assert kv.allocate(first, NO_HIT, 4) is not None
    first.num_computed_tokens = 4
    kv.free(first)
    again = request("b", [1, 2, 3, 4])  # all cached, but its last token must be computed to sample
    hit = kv.lookup(again.token_ids[:-1], None)
    assert hit.num_tokens == 3 and hit.partial is not None and not hit.partial.whole
    taken = kv.allocate(again, hit, 1)
    assert taken is not None and copies == [(hit.partial.page, taken[1])]
    kv.check_writable("b", 3, 4)
    again.num_computed_tokens = 4
    kv.commit(again, 4)
    kv.check_integrity()


def test_a_stopped_request_keeps_its_partial_page_for_its_continuation() -> None:
    kv = KVCacheManager(8, PAGE)
    turn = request("t1", [1, 2, 3, 4, 5])  # two full pages and one token in a third
    assert kv.allocate(turn, NO_HIT, 5) is not None
    pages = list(kv.page_table("t1"))
    turn.num_computed_tokens = 5
    kv.free(turn)  # the turn stops: all 5 tokens of KV stay
    kv.check_integrity()
    assert kv.num_cached == 3
    nxt = request("t2", [1, 2, 3, 4, 5, 7, 8])
    hit = kv.lookup(nxt.token_ids[:-1], None)
    assert list(hit.pages) == pages[:2] and hit.partial is not None and hit.partial.num_tokens == 1
    assert hit.num_tokens == 5
    taken = kv.allocate(nxt, hit, 2)
    assert taken is not None and taken[:3] == pages and len(taken) == 4
    assert not kv.index.is_cached(pages[2]), "claimed: now private, the next turn writes past it"
    kv.check_writable("t2", 5, 7)
    other = kv.lookup([1, 2, 3, 4, 5, 9], None)
    assert other.partial is None, "a claimed page is not offered twice"
    kv.check_integrity()


def test_refused_allocation_changes_nothing() -> None:
    kv = KVCacheManager(3, PAGE)
    a = request("a", [1, 2, 3, 4])
    assert kv.allocate(a, NO_HIT, 4) is not None
    a.num_computed_tokens = 4
    kv.free(a)  # two cached pages, one free
    b = request("b", [1, 2, 3, 4, 9, 9, 9, 9, 9])
    hit = kv.lookup(b.token_ids[:-1], None)
    assert hit.num_tokens == 4
    before = snapshot(kv)
    # The hit's two pages stop being evictable once taken: 1 free page cannot hold 3 more.
    assert not kv.can_allocate(b, hit, 5) and kv.allocate(b, hit, 5) is None
    assert snapshot(kv) == before
    kv.check_integrity()


def test_empty_salt_roots_do_not_accumulate() -> None:
    kv = KVCacheManager(64, PAGE)
    scheduler = Scheduler(kv, SchedulerLimits(4, 64), EngineCounters())
    runner = FakeRunner()
    for i in range(10_000):
        seq = request(f"r{i}", [1, 2, 3], salt=f"agent-{i}")
        scheduler.add(seq)
        if i % 100 == 0:  # now and then the request runs and caches pages under its salt first
            runner.step(scheduler)
        scheduler.finish(seq, "abort")
        kv.evict(kv.num_cached)
    assert kv.index.num_roots == 0 and kv.index.num_pages == 0
    kv.check_integrity()


def test_a_request_continuing_part_of_a_partial_page_gets_a_copy() -> None:
    copies: list[tuple[int, int]] = []
    kv = KVCacheManager(8, 4, copy_page=lambda src, dst: copies.append((src, dst)))
    turn = request("t1", [1, 2, 3, 4, 5, 6, 7])  # one full page, three tokens in a second
    assert kv.allocate(turn, NO_HIT, 7) is not None
    head_page, partial_page = kv.page_table("t1")
    turn.num_computed_tokens = 7
    kv.free(turn)
    assert kv.lookup([1, 2, 3, 4, 5, 9], None).partial is None, "one token is not worth a page copy"
    sibling = request("s", [1, 2, 3, 4, 5, 6, 9, 9])  # shares two tokens of the partial page
    hit = kv.lookup(sibling.token_ids[:-1], None)
    assert hit.partial is not None and not hit.partial.whole and hit.num_tokens == 6
    taken = kv.allocate(sibling, hit, 2)
    assert taken is not None and taken[0] == head_page and taken[1] != partial_page
    assert copies == [(partial_page, taken[1])]
    assert kv.index.is_cached(partial_page), "the owner's partial page stays cached"
    kv.check_writable("s", 6, 8)
    kv.check_integrity()
    nxt = request("t2", [1, 2, 3, 4, 5, 6, 7, 8, 9])  # the owner's next turn continues it whole
    hit = kv.lookup(nxt.token_ids[:-1], None)
    assert hit.partial is not None and hit.partial.whole and hit.num_tokens == 7
    assert kv.allocate(nxt, hit, 2) == [head_page, partial_page, *kv.page_table("t2")[2:]]
    kv.check_integrity()
