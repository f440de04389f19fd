"""A fixed pool of KV pages with a refcount each: how many live requests hold the page."""

from __future__ import annotations


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages `num_tokens` tokens occupy: the last one may be partly filled."""
    return -(-num_tokens // page_size)


class PagePool:
    """Hands out page ids and counts holders; knows nothing about tokens, tensors or the prefix index."""

    def __init__(self, num_pages: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"a page pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.refcounts = [0] * num_pages
        # A stack: recently freed pages are reused first, which keeps the touched set small.
        self._free = list(range(num_pages - 1, -1, -1))
        self._is_free = [True] * num_pages
        self.num_held = 0
        self.version = 0  # bumped by every change to refcounts or the free list

    @property
    def num_free(self) -> int:
        """Pages that hold nothing at all."""
        return len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        """Take `num_pages` free pages, each held once by the caller."""
        assert num_pages <= len(self._free), "allocate() beyond the free list"
        pages = [self._free.pop() for _ in range(num_pages)]
        self.version += bool(pages)
        for page in pages:
            self._is_free[page] = False
            self.refcounts[page] = 1
        self.num_held += num_pages
        return pages

    def retain(self, pages: list[int]) -> None:
        """Add one holder to each page (a request taking a cached or shared page)."""
        self.version += bool(pages)
        for page in pages:
            assert not self._is_free[page], f"retain of free page {page}"
            self.num_held += self.refcounts[page] == 0
            self.refcounts[page] += 1

    def release(self, pages: list[int]) -> list[int]:
        """Drop one holder from each page; return the pages no request holds any more."""
        unheld = []
        self.version += bool(pages)
        for page in pages:
            assert self.refcounts[page] > 0, f"release of unheld page {page}"
            self.refcounts[page] -= 1
            if self.refcounts[page] == 0:
                unheld.append(page)
        self.num_held -= len(unheld)
        return unheld

    def free(self, pages: list[int]) -> None:
        """Return unheld pages to the free list."""
        self.version += bool(pages)
        for page in pages:
            assert self.refcounts[page] == 0 and not self._is_free[page], f"bad free of page {page}"
            self._is_free[page] = True
            self._free.append(page)

    def is_free(self, page: int) -> bool:
        """Whether the page is on the free list."""
        return self._is_free[page]
