"""Session-aware retention: each eviction rank, in order, on the KV manager alone (no model)."""

from __future__ import annotations

import pytest

from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.sequence import Sequence
from swarmkv.kv import KVCacheManager, Rank, Retention
from swarmkv.kv.radix_index import Node
from swarmkv.kv.retention import PageMarks

PAGE = 2
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
HEAD = [1, 2, 3, 4]  # two pages every session starts with


class Books:
    """A KV manager plus the moves the engine makes for session turns."""

    def __init__(self, policy: str = "session", num_pages: int = 64) -> None:
        self.kv = KVCacheManager(num_pages, PAGE, retention=Retention(policy))  # type: ignore[arg-type]
        self.n = 0

    def start(self, tokens: list[int], session: str | None) -> Sequence:
        """Open a turn (queued, not admitted)."""
        self.n += 1
        seq = Sequence(f"r{self.n}", tokens, PARAMS, session_id=session)
        if session is not None:
            self.kv.open_turn(seq)
        return seq

    def run(self, seq: Sequence) -> Sequence:
        """Admit, compute every token, finish."""
        hit = self.kv.lookup(seq.token_ids[:-1], None)
        assert self.kv.allocate(seq, hit, seq.num_tokens - hit.num_tokens) is not None
        seq.num_computed_tokens = seq.num_tokens
        self.kv.commit(seq, seq.num_tokens)
        self.kv.free(seq)
        self.kv.retention.close(seq.request_id)
        self.kv.check_integrity()
        return seq

    def turn(self, tokens: list[int], session: str | None) -> Sequence:
        return self.run(self.start(tokens, session))

    def pages(self, tokens: list[int]) -> list[int]:
        """The device pages caching the full pages of `tokens`."""
        return list(self.kv.lookup(tokens, None).pages)


def evicted_in_order(books: Books) -> list[int]:
    """Evict one page at a time until nothing is cached; the pages in eviction order."""
    order: list[int] = []
    cached = {p for p in range(books.kv.num_pages) if books.kv.index.is_cached(p)}
    while books.kv.evict(1):
        now = {p for p in range(books.kv.num_pages) if books.kv.index.is_cached(p)}
        (gone,) = cached - now
        order.append(gone)
        cached = now
        books.kv.check_integrity()
    return order


def build_every_rank(books: Books) -> dict[Rank, list[int]]:
    """One page set per rank, in one tree; returns the full pages of each."""
    released = books.turn([*HEAD, 10, 11, 12], "a")  # session a ends
    books.kv.retention.release("a")
    old = books.turn([*HEAD, 20, 21, 22], "b")  # b's first turn...
    books.turn([*HEAD, 30, 31, 32], "b")  # ...superseded by a retry that diverges right after the head
    anon = books.turn([*HEAD, 50, 51, 52], None)  # a request without a session
    books.turn([*HEAD, 60, 61, 62], "d")  # a second paused session: the head is now shared
    paused = [*HEAD, 30, 31, 32]
    return {
        Rank.RELEASED: books.pages(released.token_ids)[2:],
        Rank.SUPERSEDED: books.pages(old.token_ids)[2:],
        Rank.ACTIVE: books.pages(anon.token_ids)[2:],
        Rank.PAUSED: books.pages(paused)[2:] + books.pages([*HEAD, 60, 61, 62])[2:],
        Rank.SHARED: books.pages(HEAD),
    }


def test_each_rank_goes_in_the_documented_order() -> None:
    books = Books("session")
    ranks = build_every_rank(books)
    order = evicted_in_order(books)
    position = {page: i for i, page in enumerate(order)}
    for earlier, later in zip(list(Rank), list(Rank)[1:], strict=False):
        assert max(position[p] for p in ranks[earlier]) < min(position[p] for p in ranks[later]), (
            f"{earlier.name} pages should all go before {later.name} pages: {order}"
        )


def test_the_key_names_each_rank() -> None:
    books = Books("session")
    ranks = build_every_rank(books)
    for rank, pages in ranks.items():
        assert pages, f"the tree holds no {rank.name} page"
        for page in pages:
            assert books.kv.retention.key(books.kv.index.node(page))[0] == rank


def test_a_session_with_a_running_request_ranks_its_other_pages_as_active() -> None:
    retention = Retention("session")
    retention.open("r1", "h")
    retention.run("r1", running=True)
    node = Node(key=(1, 2), page=0, parent=None, marks=PageMarks(owners={"h"}, reach={"h": 1}))
    assert retention.key(node) == (Rank.ACTIVE, 0)
    retention.run("r1", running=False)
    assert retention.key(node)[0] == Rank.PAUSED


def test_lru_ignores_sessions() -> None:
    books = Books("lru")
    ranks = build_every_rank(books)
    assert books.kv.retention.key(books.kv.index.node(ranks[Rank.SHARED][0])) == ()
    order = evicted_in_order(books)
    position = {page: i for i, page in enumerate(order)}
    # Last use decides: b's paused tail was computed before the anonymous request's pages, so it goes
    # first, where the session policy keeps it past them.
    b_tail = ranks[Rank.PAUSED][:1]  # b's retry, computed before the anonymous request (d's came after)
    assert max(position[p] for p in b_tail) < min(position[p] for p in ranks[Rank.ACTIVE])


def test_paused_sessions_go_least_recently_active_first() -> None:
    books = Books("session")
    books.turn([*HEAD, 9], None)  # the head, cached by a request of no session
    d = books.start([*HEAD, 60, 61, 62], "d")
    e = books.start([*HEAD, 70, 71, 72], "e")
    books.run(d)  # d's pages are computed first (older under LRU)...
    books.run(e)
    books.turn([*HEAD, 60, 61, 62, 63], "d")  # ...but d came back and paused again since: e idles longest
    d_tail = books.pages([*HEAD, 60, 61, 62, 63])[2:]
    e_tail = books.pages([*HEAD, 70, 71])[2:]
    order = evicted_in_order(books)
    assert max(order.index(p) for p in e_tail) < min(order.index(p) for p in d_tail)


def test_a_new_turn_protects_the_tail_it_continues_before_admission() -> None:
    books = Books("session")
    first = books.turn([*HEAD, 80, 81, 82, 83], "f")
    tail = books.pages(first.token_ids)[2:]
    books.turn([*HEAD, 90, 91, 92, 93], "g")  # another session, paused
    books.start([*first.token_ids, 84, 85], "f")  # f returns; not admitted yet
    for page in tail:
        node = books.kv.index.node(page)
        assert books.kv.retention.reach(node) == {"f": 1}
    order = evicted_in_order(books)
    assert not set(order[:2]) & set(tail), "the returning session's tail should outlive a paused one's"


def test_release_of_an_unknown_session_is_false() -> None:
    books = Books("session")
    assert not books.kv.retention.release("nobody")
    books.turn([*HEAD, 1], "x")
    assert books.kv.retention.release("x") and not books.kv.retention.release("x")


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="retention"):
        Retention("fifo")  # type: ignore[arg-type]


def test_a_request_id_reused_in_another_session_keeps_both_books() -> None:
    books = Books("session")
    first = Sequence("same", [*HEAD, 5, 6, 7], PARAMS, session_id="s")
    books.kv.open_turn(first)
    books.run(first)  # s's newest turn, finished: its path stays reached by s
    again = Sequence("same", [*HEAD, 8, 9, 10], PARAMS, session_id="t")
    books.kv.open_turn(again)
    books.run(again)
    assert books.kv.retention.release("s")
    assert evicted_in_order(books), "eviction must not trip over the released session's books"
    assert books.kv.retention.release("t")


def test_a_released_sessions_partial_tail_ranks_as_released() -> None:
    books = Books()
    books.turn([*HEAD, 7, 8, 9], "gone")  # 7 tokens: the last page is partial when the turn stops
    assert books.kv.retention.release("gone")
    tail = books.kv.index.path([*HEAD, 7, 8, 9], None)[-1]
    assert len(tail.key) < PAGE and books.kv.retention.owners(tail) == ["gone"]
    assert books.kv.retention.key(tail)[0] is Rank.RELEASED
