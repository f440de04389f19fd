"""The host offload tier on the KV manager alone: books and page contents through evictions, loads, swaps
and host drops, checked against a model of what each page holds."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from hypothesis import given, settings
from hypothesis import strategies as st

from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.sequence import Sequence
from swarmkv.kv import KVCacheManager, Retention

PAGE = 2
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class Contents:
    """What each device and host page holds, as token tuples: a stand-in for the KV tensors."""

    def __init__(self) -> None:
        self.device: dict[int, tuple[int, ...]] = {}
        self.host: dict[int, tuple[int, ...]] = {}
        self.loads = 0

    def copy_page(self, src: int, dst: int) -> None:
        self.device[dst] = self.device[src]

    def offload(self, moves: Seq[tuple[int, int]]) -> None:
        for page, host in moves:
            self.host[host] = self.device[page]

    def load(self, moves: Seq[tuple[int, int]]) -> None:
        self.loads += len(moves)
        for host, page in moves:
            self.device[page] = self.host[host]


def manager(num_pages: int, num_host: int, policy: str = "session") -> tuple[KVCacheManager, Contents]:
    contents = Contents()
    kv = KVCacheManager(
        num_pages,
        PAGE,
        copy_page=contents.copy_page,
        retention=Retention(policy),  # type: ignore[arg-type]
        num_host_pages=num_host,
        mover=contents,
    )
    return kv, contents


def compute(kv: KVCacheManager, contents: Contents, seq: Sequence, start: int, end: int) -> None:
    """Write tokens [start, end) of `seq` into its pages, as a forward would."""
    table = kv.page_table(seq.request_id)
    for pos in range(start, end):
        page = table[pos // PAGE]
        held = contents.device.get(page, ())[: pos % PAGE]
        contents.device[page] = (*held, seq.token_ids[pos])
    seq.num_computed_tokens = end
    kv.commit(seq, end)


def admit(kv: KVCacheManager, contents: Contents, seq: Sequence) -> bool:
    hit = kv.lookup(seq.token_ids[: seq.num_tokens - 1], seq.cache_salt)
    if kv.allocate(seq, hit, seq.num_tokens - hit.num_tokens) is None:
        return False
    compute(kv, contents, seq, hit.num_tokens, seq.num_tokens)
    return True


def check_contents(kv: KVCacheManager, contents: Contents) -> None:
    """Every cached page, on either tier, holds exactly the tokens its tree node says."""
    stack = list(kv.index._roots.values())
    while stack:
        node = stack.pop()
        for child in node.children.values():
            where = (
                contents.device.get(child.page) if child.page is not None else contents.host.get(child.host)
            )  # type: ignore[arg-type]
            assert where is not None and where[: len(child.key)] == child.key, f"{child.key} holds {where}"
            stack.append(child)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["run", "swap", "evict", "release"]),
            st.lists(st.integers(0, 2), min_size=1, max_size=10),
            st.sampled_from([None, "s1", "s2"]),
            st.integers(1, 6),
        ),
        max_size=30,
    ),
    num_pages=st.integers(2, 10),
    num_host=st.integers(0, 8),
)
def test_tiers_keep_the_books_and_the_contents(ops: list, num_pages: int, num_host: int) -> None:
    kv, contents = manager(num_pages, num_host)
    for n, (op, tokens, session, count) in enumerate(ops):
        if op == "evict":
            kv.evict(count)
        elif op == "release" and session is not None:
            kv.retention.release(session)
        else:
            seq = Sequence(f"r{n}", tokens, PARAMS, session_id=session)
            if session is not None:
                kv.open_turn(seq)
            if admit(kv, contents, seq):
                private = kv.private_pages(seq.request_id)
                kv.free(seq)
                if op == "swap":
                    kv.swap_out(private)
            kv.retention.close(seq.request_id)
        kv.check_integrity()
        check_contents(kv, contents)
        assert kv.num_in_use == 0


def test_an_evicted_prefix_comes_back_from_the_host() -> None:
    kv, contents = manager(num_pages=4, num_host=8)
    first = Sequence("a", [1, 2, 3, 4, 5], PARAMS)
    assert admit(kv, contents, first)
    kv.free(first)
    assert kv.evict(3) == 3 and kv.num_offloaded == 3
    again = Sequence("b", [1, 2, 3, 4, 5, 6], PARAMS)
    hit = kv.lookup(again.token_ids[:-1], None)
    assert (
        hit.num_tokens == 5 and len(hit.host_pages) == 2 and hit.partial is not None and hit.partial.on_host
    )
    assert kv.allocate(again, hit, 1) is not None
    assert contents.loads == 3 and kv.host.counters.loads == 3
    compute(kv, contents, again, 5, 6)
    kv.check_integrity()
    check_contents(kv, contents)


def test_requests_for_the_same_offloaded_pages_share_one_load() -> None:
    kv, contents = manager(num_pages=8, num_host=8)
    first = Sequence("a", [1, 2, 3, 4, 5], PARAMS)
    assert admit(kv, contents, first)
    kv.free(first)
    kv.evict(8)
    for rid, last in (("b", 7), ("c", 8)):
        assert admit(kv, contents, Sequence(rid, [1, 2, 3, 4, last], PARAMS))
    assert contents.loads == 2, "the second request should hit the pages the first one loaded"
    kv.check_integrity()


def test_a_full_host_tier_drops_its_least_recently_used_leaf() -> None:
    kv, contents = manager(num_pages=2, num_host=2)
    for rid, tokens in (("a", [1, 2, 3]), ("b", [4, 5, 6]), ("c", [7, 8, 9])):
        seq = Sequence(rid, tokens, PARAMS)
        assert admit(kv, contents, seq)
        kv.free(seq)
        kv.check_integrity()
    assert kv.host.counters.drops > 0 and kv.num_offloaded == 2
    assert kv.lookup([1, 2, 3], None).num_tokens == 0, "the oldest prefix should be the one dropped"
    check_contents(kv, contents)


def test_swap_out_moves_only_the_private_tail() -> None:
    kv, contents = manager(num_pages=8, num_host=8)
    head = Sequence("head", [1, 2, 3, 4], PARAMS)
    assert admit(kv, contents, head)
    kv.free(head)
    keeper = Sequence("keeper", [1, 2, 3, 4, 9], PARAMS)
    assert admit(kv, contents, keeper)  # holds the head
    seq = Sequence("s", [1, 2, 3, 4, 5, 6, 7], PARAMS)
    assert admit(kv, contents, seq)
    private = kv.private_pages("s")
    assert len(private) == 2, "the shared head is not private"
    kv.free(seq)
    assert kv.swap_out(private) == 2 and kv.num_offloaded == 2
    kv.check_integrity()
    check_contents(kv, contents)
