"""Property tests of the page pool and the radix cache on their own, without a model."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from swarmkv.kv import NoSharingCache, PagePool, PrefixCache, RadixCache

BLOCK = 2
seq_tokens = st.lists(st.integers(0, 3), min_size=1, max_size=12)


def admit(cache: PrefixCache, tokens: list[int], salt: str | None) -> list[int] | None:
    """What the scheduler does, in one go."""
    return cache.admit(tokens, salt)


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), seq_tokens, st.sampled_from([None, "x"]), st.integers(0, 9)), max_size=40
    ),
    num_pages=st.integers(1, 12),
    sharing=st.booleans(),
)
def test_random_admissions_and_releases_keep_the_books(ops: list, num_pages: int, sharing: bool) -> None:
    pool = PagePool(num_pages)
    cache: PrefixCache = RadixCache(pool, BLOCK) if sharing else NoSharingCache(pool, BLOCK)
    live: list[tuple[list[int], list[int], str | None]] = []
    for add, tokens, salt, pick in ops:
        if add or not live:
            pages = admit(cache, tokens, salt)
            if pages is not None:
                assert len(pages) == -(-len(tokens) // BLOCK)
                live.append((tokens, pages, salt))
        else:
            _, pages, _ = live.pop(pick % len(live))
            cache.release(pages)
        cache.check_integrity([p for _, p, _ in live])
    for tokens, pages, salt in live:
        hit = cache.match(tokens, salt)
        # Every full page a live sequence inserted is findable again (it cannot have been evicted).
        assert hit.pages == (pages[: len(tokens) // BLOCK] if sharing else [])
        cache.release(hit.pages)
    for _, pages, _ in live:
        cache.release(pages)
    cache.check_integrity([])
    assert pool.num_held == 0
    cache.evict(num_pages)
    assert pool.num_free == num_pages


def test_shared_head_is_evicted_last() -> None:
    pool = PagePool(8)
    cache = RadixCache(pool, BLOCK)
    head = [1, 1, 2, 2]
    a = admit(cache, [*head, 3, 3], None)
    b = admit(cache, [*head, 4, 4], None)
    assert a is not None and b is not None and a[:2] == b[:2]
    cache.release(a)
    cache.release(b)
    assert cache.evict(2) == 2  # the two private tails go first
    hit = cache.match([*head, 9], None)
    assert hit.pages == a[:2], "the shared head should have survived"
    cache.release(hit.pages)
    cache.check_integrity([])


def test_salts_never_share() -> None:
    cache = RadixCache(PagePool(8), BLOCK)
    a = admit(cache, [1, 2, 3, 4, 5], "a")
    assert a is not None
    assert cache.match([1, 2, 3, 4, 5], "b").pages == []
    assert cache.match([1, 2, 3, 4, 5], None).pages == []
    hit = cache.match([1, 2, 3, 4, 5], "a")
    assert hit.pages == a[:2]
    cache.check_integrity([a, hit.pages])


def test_duplicate_blocks_are_folded_onto_the_cached_page() -> None:
    pool = PagePool(8)
    cache = RadixCache(pool, BLOCK)
    first = cache.allocate(2)
    second = cache.allocate(2)
    first = cache.insert([5, 6, 7, 8], first, None)
    second = cache.insert([5, 6, 7, 8], second, None)
    assert second == first and pool.num_free == 6  # the duplicate pages went back to the free list
    cache.check_integrity([first, second])


def test_a_stopped_sequence_keeps_its_partial_page_for_its_continuation() -> None:
    pool = PagePool(8)
    cache = RadixCache(pool, BLOCK)
    turn = [1, 2, 3, 4, 5]  # two full pages and one token in a third
    pages = cache.admit(turn, None)
    assert pages is not None and len(pages) == 3
    cache.release(cache.insert(turn, pages, None, partial=True))  # the turn stops: 5 tokens of KV stay
    cache.check_integrity([])
    assert cache.num_cached == 3
    hit = cache.match([*turn, 7, 8], None)
    assert hit.pages == pages[:2] and hit.partial is not None and hit.partial.num_tokens == 1
    assert hit.num_tokens(BLOCK) == 5
    taken = cache.claim(hit.partial)
    assert taken == pages[2] and not cache.is_cached(taken)  # now private: the next turn writes past it
    cache.check_integrity([[*hit.pages, taken]])
    other = cache.match([*turn, 9], None)
    assert other.partial is None  # claimed pages are not offered twice
    cache.release(other.pages)
    cache.release([*hit.pages, taken])
    cache.check_integrity([])
