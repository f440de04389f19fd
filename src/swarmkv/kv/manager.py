"""KVCacheManager: owns every request's page table over the page pool and the radix index.

The verbs follow vLLM v1's KV cache manager:
- `lookup` finds the cached prefix of a request's tokens and changes nothing;
- `allocate` takes references on a hit, claims or copies its partial page, evicts and allocates, all or nothing;
- `commit` indexes the pages that became full, and never rewrites a page table entry;
- `free` releases a request's pages, optionally leaving its partly filled last page cached.
Page tables are append-only, so a runner can keep them resident. A partial page is taken by a request that
continues all of its tokens; one that continues only some of them gets a copy (through `copy_page`, the
engine's KV tensors), so the page stays cached for the request that continues it whole, such as the paused
agent's next turn. A page two requests computed in a cold
race (or recomputed because a prompt ends on a page boundary) stays in the later one's table, private, and
is freed when that request ends; that request also holds the indexed copy, under which its later pages are
indexed. Without prefix caching (the per-slot layout) the same manager keeps no index at all.

Eviction follows a `Retention` policy (plain LRU, or session-aware ranks). With a host tier, an evicted page
is copied to a host page instead of being dropped and its tree node stays; a hit on host pages loads them
back inside `allocate`, before the request runs, so every request sharing them waits on that one load.
A pin holds a prefix's pages like a request would, so eviction never takes them; on a hybrid it also holds
the state snapshot at their end, without which a hit there could not resume.

For a hybrid model (`states`), pages hold the attention layers' KV and a `StateIndex` the linear-attention
layers' recurrent states: a running slot per request and snapshots keyed by the tokens before them. A hit is
then the deepest snapshot at or before the page match, with the pages cut back to it; a partial page is
always copied, never claimed, so the page a snapshot's position falls in stays cached for every request
that resumes there. Snapshots are taken at a stopped request's end (`free`), at its prompt's end and at the
points the scheduler cuts prefills at (`snapshot`); `StateIndex` keeps each conversation's newest prompt end
and turn end, and lets the ones it moved past go first.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from swarmkv.kv.host_tier import HostTier, PageMover
from swarmkv.kv.page_pool import PagePool, pages_for
from swarmkv.kv.radix_index import Node, PageKey, PartialHit, RadixIndex, Salt
from swarmkv.kv.request import NO_HIT, Hit, KVRequest, PrefillRequest
from swarmkv.kv.retention import Retention
from swarmkv.kv.state_index import SnapshotKind, StateMover
from swarmkv.kv.state_kinds import NoStates, RecurrentStates

__all__ = ["NO_HIT", "Hit", "KVCacheManager", "KVRequest"]


@dataclass
class _Table:
    salt: Salt
    pages: list[int] = field(default_factory=list)
    # The index's pages for our first len(path) pages, a path from the salt's root. path[i] is pages[i]
    # unless our page duplicates one the index held already; we then hold that one too (in `shadow`), so
    # that our later pages index under it and it cannot be evicted from under them.
    path: list[int] = field(default_factory=list)
    shadow: list[int] = field(default_factory=list)


class KVCacheManager:
    """Request -> pages over a `PagePool`; with `prefix_caching`, full pages are shared through a radix index."""

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        prefix_caching: bool = True,
        copy_page: Callable[[int, int], None] | None = None,
        retention: Retention | None = None,
        num_host_pages: int = 0,
        mover: PageMover | None = None,
        num_state_slots: int = 0,
        state_mover: StateMover | None = None,
    ) -> None:
        """`copy_page(src, dst)` copies a page's KV, `mover` copies between the tiers and `state_mover`
        between state slots; without them (bookkeeping only) copies are not made. `num_host_pages` sizes
        the host tier (0: none); `num_state_slots` the recurrent-state pool of a hybrid model (0: none)."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, got {page_size}")
        self.pool = PagePool(num_pages)
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.index = RadixIndex(self.pool, page_size)
        self.retention = retention or Retention("lru")
        self.host = HostTier(num_host_pages if prefix_caching else 0, mover)
        self._copy_page = copy_page
        self._tables: dict[str, _Table] = {}
        self._pins: dict[str, list[int]] = {}
        self._pin_holds: Counter[int] = Counter()  # device page -> pins holding it, kept as pins come and go
        self._pin_states: dict[str, int] = {}  # hybrids: pin -> the state slot of the snapshot it holds
        self.num_evictions = 0
        # The recurrent-state cache kind beside the pages: a hybrid's slots, or none.
        self.states: NoStates = (
            RecurrentStates(num_state_slots, state_mover) if num_state_slots else NoStates()
        )

    # Reading.

    @property
    def num_pages(self) -> int:
        """Pages in the pool."""
        return self.pool.num_pages

    @property
    def num_free(self) -> int:
        """Pages on the free list."""
        return self.pool.num_free

    @property
    def num_in_use(self) -> int:
        """Pages held by at least one request."""
        return self.pool.num_held

    @property
    def num_cached(self) -> int:
        """Indexed pages no request holds: kept for future hits, reclaimed on demand."""
        return self.pool.num_pages - self.pool.num_free - self.pool.num_held

    @property
    def num_offloaded(self) -> int:
        """Host pages holding evicted KV."""
        return self.index.num_host_pages

    @property
    def num_pinned(self) -> int:
        """Device pages some pin holds."""
        return len(self._pin_holds)

    @property
    def num_pinned_states(self) -> int:
        """Hybrids: state snapshots some pin holds (one two pins share counts once)."""
        return len(set(self._pin_states.values()))

    def all_pinned_pages(self) -> frozenset[int]:
        """Device pages some pin holds (a page two pins share is listed once)."""
        return frozenset(self._pin_holds)

    @property
    def has_states(self) -> bool:
        """Whether a hybrid model's recurrent-state slots sit beside the pages."""
        return self.states.enabled

    @property
    def takes_snapshots(self) -> bool:
        """Whether prefix hits resume recurrent states, so the scheduler cuts prefills where they pay."""
        return self.states.enabled and self.prefix_caching

    @property
    def num_open_sessions(self) -> int:
        """Sessions not released."""
        return self.retention.num_open

    @property
    def num_paused_sessions(self) -> int:
        """Open sessions with no request running."""
        return self.retention.num_paused

    @property
    def tree_version(self) -> tuple[int, int]:
        """Changes whenever the prefix index's nodes or the pages' holders change: an export of the tree
        (`export()`) made at one version holds until the next."""
        return self.index.version, self.pool.version

    def export(self) -> list[dict[str, Any]]:
        """The prefix index's nodes as plain data (`RadixIndex.export`), with the sessions that used each."""
        return self.index.export(self.retention.owners)

    def page_table(self, request_id: str) -> Sequence[int]:
        """The request's pages, in token order (empty if it holds none). Read-only."""
        table = self._tables.get(request_id)
        return table.pages if table else ()

    def holds_pages(self, request_id: str) -> bool:
        """Whether the request has a page table."""
        return request_id in self._tables

    def lookup(self, tokens: Sequence[int], salt: Salt, keys: Sequence[PageKey] | None = None) -> Hit:
        """The longest cached prefix of `tokens` under `salt` (`keys`: the page keys of its full pages, when
        the caller keeps them, so they are not built again); no references taken, nothing changed."""
        if not self.prefix_caching:
            return NO_HIT
        hit = self._page_hit(tokens, salt, keys)
        return self.states.resume(tokens, salt, hit, lambda prefix: self._page_hit(prefix, salt))

    def _page_hit(self, tokens: Sequence[int], salt: Salt, keys: Sequence[PageKey] | None = None) -> Hit:
        pages, host_pages, partial = self.index.lookup(tokens, salt, keys)
        min_copy = self.states.min_partial_copy(self.page_size)
        if partial is not None and not partial.whole and partial.num_tokens < min_copy:
            partial = None
        num_full = len(pages) + len(host_pages)
        num_tokens = num_full * self.page_size + (partial.num_tokens if partial else 0)
        return Hit(tuple(pages), partial, num_tokens, tuple(host_pages), branch_tokens=num_tokens)

    def num_new_pages(self, request: KVRequest, hit: Hit, num_new_tokens: int) -> int:
        """Pages `allocate` would take from the pool (or from eviction) for this call."""
        table = self._tables.get(request.request_id)
        if table is None:
            whole = hit.partial is not None and hit.partial.whole and not self.states.copies_partials
            have, base = len(hit.pages) + len(hit.host_pages) + whole, hit.num_tokens
        else:
            have, base = len(table.pages), request.num_computed_tokens
        return max(0, pages_for(base + num_new_tokens, self.page_size) - have)

    def can_allocate(self, request: KVRequest, hit: Hit, num_new_tokens: int) -> bool:
        """Whether `allocate` with these arguments would succeed."""
        # Hit pages nobody holds are evictable now, but taking them removes them from the evictable set;
        # a partial page on the device is always unheld, and is claimed out of it or held there until
        # copied. Each host page to load needs a device page of its own.
        partial = hit.partial
        on_device = partial is not None and not partial.on_host and self.pool.refcounts[partial.page] == 0
        taken = sum(1 for p in hit.pages if self.pool.refcounts[p] == 0) + on_device
        available = self.pool.num_free + self.num_cached - taken
        if request.request_id not in self._tables and not self.states.can_start():
            return False
        return self.num_new_pages(request, hit, num_new_tokens) + hit.num_loads <= available

    # Changing.

    def allocate(self, request: KVRequest, hit: Hit, num_new_tokens: int) -> list[int] | None:
        """Give the request KV for `num_new_tokens` tokens past its computed ones (past `hit` for a request
        without pages yet). Returns the pages appended to its table (the hit's included), or None with
        nothing changed if the pool cannot, even after evicting every unheld cached page."""
        rid = request.request_id
        assert hit is NO_HIT or rid not in self._tables, "a hit is only for a request without pages"
        if not self.can_allocate(request, hit, num_new_tokens):
            return None
        needed = self.num_new_pages(request, hit, num_new_tokens)
        table = self._tables.get(rid)
        appended: list[int] = []
        partial = hit.partial
        copy_from: int | None = None
        if table is None:
            table = self._tables[rid] = _Table(request.cache_salt)
            self.pool.retain(list(hit.pages))
            self.index.touch(hit.pages)
            loaded = self._load([*hit.host_pages, *([partial.page] if partial and partial.on_host else [])])
            if partial is not None:
                page = loaded.pop() if partial.on_host else partial.page
                if partial.on_host:
                    self.pool.release([page])  # unheld again, like any cached partial page
                partial = PartialHit(page, partial.num_tokens, partial.whole)
            self.retention.run(rid, running=True)  # after its loads: their evictions rank it as paused
            table.path = [*hit.pages, *loaded]
            appended += table.path
            self.retention.tag(self._nodes(table.path), request.session_id)
            self.states.start(rid, hit)
            if partial is not None and partial.whole and not self.states.copies_partials:
                self.index.detach(partial.page)
                self.pool.retain([partial.page])
                appended.append(partial.page)
            elif partial is not None:
                copy_from = partial.page
                self.pool.retain([copy_from])  # not evictable until copied below
        self._make_room(needed)
        new_pages = self.pool.allocate(needed)
        if copy_from is not None:
            if self._copy_page is not None:
                self._copy_page(copy_from, new_pages[0])
            self.pool.release([copy_from])
            self.index.touch([copy_from])
        appended += new_pages
        table.pages += appended
        return appended

    def state_slots(self, request_ids: Sequence[str]) -> dict[str, int]:
        """The running requests' state slots (hybrid models; empty otherwise)."""
        return self.states.slots(request_ids)

    def first_unsnapshotted(self, tokens: Sequence[int], salt: Salt, points: Sequence[int]) -> int | None:
        """The first of these ascending positions where no state snapshot of `tokens` is kept yet: where a
        prefill is worth cutting to take one. None if every one has a snapshot."""
        return self.states.first_unsnapshotted(tokens, salt, points)

    def snapshot_point(
        self,
        request: PrefillRequest,
        span: tuple[int, int],
        branch_tokens: int,
        turn_tokens: int,
        others: Iterable[PrefillRequest],
    ) -> int | None:
        """Where a prefill chunk over `span` should end instead, for the cache kind to keep what a later hit
        resumes from (a hybrid's state snapshot); None: at its end (see `state_kinds`)."""
        if not self.prefix_caching:
            return None
        return self.states.snapshot_point(request, span, branch_tokens, turn_tokens, others)

    def prefix_in_flight(self, request: PrefillRequest, hit: Hit, running: Iterable[PrefillRequest]) -> bool:
        """Whether one of the `running` prefills is about to compute what the waiting `request` could hit past
        `hit`, so that it should wait for it rather than compute it too."""
        return self.prefix_caching and self.states.computing(request, hit, running, self.page_size)

    def rewind(self, request_id: str, num_positions: int) -> None:
        """A speculative chunk ran for the request: what the cache kind holds per request (a hybrid's state)
        becomes what it was after the chunk's first `num_positions` positions (the pages need nothing: only
        accepted positions count as computed)."""
        self.states.rewind(request_id, num_positions)

    def can_swap_out(self, num_pages: int) -> bool:
        """Whether the host tier has `num_pages` free pages now, dropping nothing."""
        return self.host.num_free >= num_pages

    def snapshot(self, request: KVRequest, kind: SnapshotKind = "branch") -> bool:
        """Keep the running request's state after its computed tokens (a point the scheduler cut its prefill
        at, a "branch", or its prompt's end, a "prompt", as the prefill's last chunk is committed, before any
        token sampled after it runs). At a branch, also cache a copy of its partly filled last page when no
        cached page holds those tokens yet, so every request sharing them resumes there at once (a prompt's
        page is cached when the request stops). Whether a snapshot was stored: never where hits resume no
        state (a plain transformer, or no prefix caching)."""
        if not self.takes_snapshots:
            return False
        table = self._tables[request.request_id]
        computed = request.num_computed_tokens
        self.commit(request, computed)
        stored = self.states.store(request, computed, kind)
        full, rest = divmod(computed, self.page_size)
        if not stored or kind != "branch" or not rest or len(table.path) < full:
            return stored
        tokens = request.token_ids
        if self._page_hit(tokens[:computed], table.salt).num_tokens >= computed:
            return stored
        if self.pool.num_free + self.num_cached < 1:
            return stored  # the pages before the snapshot are cached; this one is computed again on a hit
        self._make_room(1)
        (page,) = self.pool.allocate(1)
        if self._copy_page is not None:
            self._copy_page(table.pages[full], page)
        parent = table.path[full - 1] if full else None
        indexed = self.index.insert(table.salt, parent, tuple(tokens[full * self.page_size : computed]), page)
        self.host.free(self.index.take_superseded_host())
        self.pool.release([page])  # a cached partial page is held by no one
        if indexed != page:
            self.pool.free([page])
        return stored

    def _load(self, host_pages: list[int]) -> list[int]:
        """Copy host pages back into device pages (evicting others if need be): each is then held once by
        the caller and indexed where its host page was."""
        if not host_pages:
            return []
        self._make_room(len(host_pages), keep_host=frozenset(host_pages))
        pages = self.pool.allocate(len(host_pages))
        moves = list(zip(host_pages, pages, strict=True))
        for host, page in moves:
            self.index.load(host, page)
        self.host.copy_in(moves)
        return pages

    def _make_room(self, num_pages: int, keep_host: frozenset[int] = frozenset()) -> None:
        """Evict until `num_pages` pages are free; `can_allocate` has counted them as evictable."""
        shortfall = num_pages - self.pool.num_free
        if shortfall > 0:
            evicted = self.evict(shortfall, keep_host)
            assert evicted == shortfall, "the index could not evict what it counted as evictable"

    def evict(self, num_pages: int, keep_host: frozenset[int] = frozenset()) -> int:
        """Return up to `num_pages` unheld cached pages to the free list, leaves first in the retention
        policy's order; with a host tier each one's KV moves there instead of being dropped (dropping host
        leaves for room, never those in `keep_host`)."""
        host_page = (lambda: self._host_page(keep_host)) if self.host.num_pages else None
        eviction = self.index.evict(num_pages, self.retention.key, host_page)
        self.host.copy_out(eviction.moved)  # before the device pages are handed out again
        self.host.drop(eviction.dropped_host)
        self.pool.free(eviction.device_pages)
        self.num_evictions += len(eviction.device_pages)
        return len(eviction.device_pages)

    def _host_page(self, keep: frozenset[int]) -> int | None:
        """A free host page, dropping the least recently used host leaf not in `keep` if there is none."""
        page = self.host.allocate()
        if page is None:
            self.host.drop(self.index.drop_host(1, keep))
            page = self.host.allocate()
        return page

    def swap_out(self, pages: Sequence[int]) -> int:
        """Move these unheld device pages (a stopped request's private tail, in token order) to free host
        pages now, dropping nothing there; returns how many moved."""
        moved = self.index.offload(pages, self.host.allocate)
        self.host.copy_out(moved)
        self.pool.free([page for page, _ in moved])
        return len(moved)

    def private_pages(self, request_id: str) -> list[int]:
        """The request's pages no other request or pin holds, in token order."""
        table = self._tables.get(request_id)
        if table is None:
            return []
        return [p for p in table.pages if self.pool.refcounts[p] == 1 and p not in table.shadow]

    def pin(self, pin_id: str, tokens: Sequence[int], salt: Salt) -> int:
        """Hold the device pages of the cached full-page prefix of `tokens` under `pin_id`, so eviction
        cannot take them, and on a hybrid the state snapshot at their end where one is kept (a hit there
        resumes from it); returns the tokens pinned."""
        assert pin_id not in self._pins, f"pin {pin_id} exists"
        pages, _, _ = self.index.lookup(tokens, salt) if self.prefix_caching else ([], [], None)
        self.pool.retain(pages)
        self.index.touch(pages)
        self._pins[pin_id] = pages
        self._pin_holds.update(pages)
        num_tokens = len(pages) * self.page_size
        slot = self.states.hold(tokens[:num_tokens], salt) if num_tokens else None
        if slot is not None:
            self._pin_states[pin_id] = slot
        return num_tokens

    def pin_is_cached(self, tokens: Sequence[int], salt: Salt) -> bool:
        """Whether `pin` would hold every whole page of `tokens` with nothing computed: the pages are on the
        device and, on a hybrid, the state after them is kept. Changes nothing."""
        num_tokens = len(tokens) // self.page_size * self.page_size
        if not self.prefix_caching or not num_tokens:
            return False
        pages, _, _ = self.index.lookup(tokens[:num_tokens], salt)
        return len(pages) * self.page_size == num_tokens and self.states.has(tokens[:num_tokens], salt)

    def pinned_state(self, pin_id: str) -> int | None:
        """Hybrids: the state slot whose snapshot the pin holds, if any."""
        return self._pin_states.get(pin_id)

    def unpin(self, pin_id: str) -> bool:
        """Let go of a pin's pages and state snapshot (they stay cached); False if there is no such pin."""
        pages = self._pins.pop(pin_id, None)
        if pages is None:
            return False
        slot = self._pin_states.pop(pin_id, None)
        if slot is not None:
            self.states.unhold(slot)
        self._pin_holds.subtract(pages)
        for page in pages:
            if not self._pin_holds[page]:
                del self._pin_holds[page]
        self.pool.release(pages)
        return True

    def pinned_pages(self, pin_id: str) -> list[int]:
        """The pages a pin holds."""
        return list(self._pins.get(pin_id, ()))

    def commit(self, request: KVRequest, num_computed_tokens: int) -> None:
        """The request's first `num_computed_tokens` tokens now have KV: index the pages that became full."""
        table = self._tables[request.request_id]
        num_full = min(num_computed_tokens // self.page_size, len(table.pages))
        if not self.prefix_caching or len(table.path) >= num_full:
            return
        size, tokens = self.page_size, request.token_ids
        while len(table.path) < num_full:
            i = len(table.path)
            parent = table.path[i - 1] if i else None
            key = tuple(tokens[i * size : (i + 1) * size])
            indexed = self.index.insert(table.salt, parent, key, table.pages[i])
            if indexed != table.pages[i]:  # computed twice: ours stays private, we hold the index's copy
                self.pool.retain([indexed])
                table.shadow.append(indexed)
            table.path.append(indexed)
            self.retention.tag([self.index.node(indexed)], request.session_id)
        self.host.free(self.index.take_superseded_host())

    def free(self, request: KVRequest, keep_partial: bool = True, keep_state: bool = True) -> None:
        """Release the request's pages. With `keep_partial` (a request that stopped running), its computed
        KV stays cached, the partly filled last page included, for a request that continues its tokens; a
        hybrid's state is snapshotted there too unless `keep_state` is False (a step failed mid-way)."""
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        computed = request.num_computed_tokens
        if keep_partial and keep_state and self.prefix_caching:
            self.states.store(request, computed, "turn")
        self.states.release(rid)
        self.commit(request, computed)
        full, rest = divmod(computed, self.page_size)
        if (
            keep_partial
            and self.prefix_caching
            and rest
            and len(table.path) == full
            and len(table.pages) > full
        ):
            key = tuple(request.token_ids[full * self.page_size : computed])
            parent = table.path[full - 1] if full else None
            # If an identical partial page is cached already, ours is not indexed and is freed below.
            partial = self.index.insert(table.salt, parent, key, table.pages[full])
            self.host.free(self.index.take_superseded_host())
            self.retention.tag([self.index.node(partial)], request.session_id)  # ranks as its session's page
            path = [*table.path, partial]
        else:
            path = table.path
        if self.prefix_caching:
            self.retention.mark_path(rid, self._nodes(path))
        self.retention.run(rid, running=False)
        del self._tables[rid]
        unheld = self.pool.release(table.pages + table.shadow)
        self.pool.free([page for page in unheld if not self.index.is_cached(page)])

    def close(self, request_id: str) -> None:
        """A request finished for good: unless it is its session's newest turn, its pages rank as unreached."""
        self.retention.close(request_id)

    def newest_turn(self, session_id: str) -> KVRequest | None:
        """The open session's newest turn (the request its next turn continues), or None."""
        turn: KVRequest | None = self.retention.newest_turn(session_id)
        return turn

    def release_session(self, session_id: str) -> bool:
        """End a session: its pages reach nothing and are the first to go. False if it is not open."""
        return self.retention.release(session_id)

    def note_tool(self, session_id: str, tool: str | None) -> bool:
        """The session's newest reply called `tool`; its return is forecast from that tool's pauses."""
        return self.retention.note_tool(session_id, tool)

    def open_turn(self, request: KVRequest) -> None:
        """The request is its session's newest turn: the cached pages its prompt continues stay reachable
        (and the session's older branch does not) from now, before it is admitted."""
        assert request.session_id is not None
        self.retention.open(request.request_id, request.session_id, request)
        if self.prefix_caching:
            tokens = request.token_ids
            self.retention.mark_path(
                request.request_id, self.index.path(tokens[: len(tokens) - 1], request.cache_salt)
            )

    def _nodes(self, pages: Sequence[int]) -> list[Node]:
        return [self.index.node(page) for page in pages]

    # Checking.

    def check_integrity(self) -> None:
        """Raise AssertionError unless pool, page tables and index agree, and sharing is safe:
        refcounts equal holders; free + cached + held == total; every page two requests hold is a full
        indexed page; a partial leaf in the index is unheld; no page is both free and indexed."""
        pool = self.pool
        holders = Counter(p for table in self._tables.values() for p in table.pages + table.shadow)
        holders.update(p for pages in self._pins.values() for p in pages)
        for page in range(pool.num_pages):
            refs = pool.refcounts[page]
            assert refs == holders.get(page, 0), f"page {page}: refcount {refs} but {holders[page]} holders"
            cached = self.index.is_cached(page)
            if pool.is_free(page):
                assert refs == 0 and not cached, f"free page {page} is held or indexed"
            else:
                assert refs > 0 or cached, f"page {page} is neither free, held nor indexed"
            if refs > 1:
                assert self.index.is_full(page), f"page {page} is held {refs} times but is not a full page"
        assert sum(1 for r in pool.refcounts if r) == pool.num_held, "pool's held count disagrees"
        for rid, table in self._tables.items():
            assert len(set(table.pages)) == len(table.pages), f"{rid} holds a page twice"
            parent: int | None = None
            for own, page in zip(table.pages, table.path, strict=False):
                assert self.index.is_full(page), f"{rid}: path page {page} is not in the index"
                assert self.index.parent_page(page) == parent, f"{rid}: page {page} is off its path"
                assert own == page or page in table.shadow, f"{rid}: holds neither its page nor the index's"
                parent = page
        if not self.prefix_caching:
            assert self.index.num_pages == 0, "the per-slot layout indexes nothing"
        host_free, host_used = self.host.free_pages(), self.index.host_pages()
        assert not host_free & host_used, f"host pages both free and indexed: {sorted(host_free & host_used)}"
        assert len(host_free) + len(host_used) == self.host.num_pages, "host pages leaked"
        assert self._pin_holds == Counter(p for pages in self._pins.values() for p in pages), (
            "pin counts drifted"
        )
        for pin_id, pages in self._pins.items():
            assert all(self.index.is_full(p) for p in pages), f"pin {pin_id} holds a page not indexed full"
        assert self._pin_states.keys() <= self._pins.keys(), "a snapshot is held for a pin that is gone"
        self.states.check(self._tables.keys(), list(self._pin_states.values()))
        self.index.check()

    def check_writable(self, request_id: str, start: int, end: int) -> None:
        """Raise AssertionError unless the pages holding positions [start, end) of the request are held by
        it alone and are not in the index: a step may write only there."""
        pages = self._tables[request_id].pages
        for i in range(start // self.page_size, pages_for(end, self.page_size)):
            page = pages[i]
            refs = self.pool.refcounts[page]
            assert refs == 1, f"{request_id} writes page {page}, which {refs} requests hold"
            assert not self.index.is_cached(page), f"{request_id} writes page {page}, which is indexed"
