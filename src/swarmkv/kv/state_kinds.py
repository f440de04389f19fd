"""The recurrent-state cache kind, as the KV manager coordinates it beside the pages.

A hybrid model (Qwen3.5) keeps, besides the attention layers' KV pages, one recurrent state per running
request and snapshots of states keyed by the exact tokens before them (`StateIndex`). The KV manager asks
this kind the questions that differ between a plain transformer and a hybrid, so it holds no `if hybrid`
branches of its own: where a prefix hit may resume (`resume`: the deepest snapshot at or before the page
match), whether a partial page may be claimed or must be copied, whether a new request can get a slot,
and what to do when a request starts, is cut at a snapshot point, or stops, and which snapshot a pin holds
beside its pages. `NoStates` answers for a plain transformer: every page hit resumes, nothing is stored.

The scheduler asks the kind two questions about prefills. Where may a chunk end (`snapshot_point`): a hybrid's
prefix hit needs a state snapshot at its end, so a chunk is cut where a snapshot pays: where the request leaves
the cached tree (a branch point, once a second request diverges there) and where it stops sharing tokens with
another queued or running request (a cold swarm's common head, computed once while the followers wait for it).
And whether a waiting request should wait for a running prefill of what it could hit (`computing`): pages for a
plain transformer, the snapshot that prefill is cut to take for a hybrid.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence

from swarmkv.kv.radix_index import Salt
from swarmkv.kv.request import Hit, KVRequest, PrefillRequest
from swarmkv.kv.state_index import MIN_SNAPSHOT_TOKENS, SnapshotKind, StateIndex, StateMover
from swarmkv.prefix import common_prefix_length

PageHit = Callable[[Sequence[int]], Hit]  # the pages' hit on a prefix of the request's tokens


class NoStates:
    """A model without recurrent layers: its cache is pages only."""

    enabled = False
    copies_partials = False  # a request continuing a cached partial page whole may take the page itself
    index: StateIndex | None = None

    def min_partial_copy(self, page_size: int) -> int:
        """Tokens a cached partial page must spare to be copied: half a page, or the copy is not worth it."""
        return page_size // 2

    def resume(self, tokens: Sequence[int], salt: Salt, hit: Hit, page_hit: PageHit) -> Hit:
        """Where a request for `tokens` resumes, given the pages' `hit`: right there."""
        return hit

    def can_start(self) -> bool:
        """Whether a new request can get what this kind holds per request."""
        return True

    def start(self, request_id: str, hit: Hit) -> None:
        """A request was given its first pages at `hit`."""

    def slots(self, request_ids: Collection[str]) -> dict[str, int]:
        """Each running request's state slot."""
        return {}

    def first_unsnapshotted(self, tokens: Sequence[int], salt: Salt, points: Sequence[int]) -> int | None:
        """The first of these ascending positions with no snapshot of `tokens` yet."""
        return None

    def snapshot_point(
        self,
        request: PrefillRequest,
        span: tuple[int, int],
        branch_tokens: int,
        turn_tokens: int,
        others: Iterable[PrefillRequest],
    ) -> int | None:
        """Where a prefill chunk over `span` ([start, end)) should end instead, to take a snapshot there; None:
        at its end. `branch_tokens`: where the request left the cached tree; `turn_tokens`: where the turn
        snapshot it resumed from ends (0: none)."""
        return None

    def computing(
        self, request: PrefillRequest, hit: Hit, running: Iterable[PrefillRequest], page_size: int
    ) -> bool:
        """Whether a running prefill is about to compute full pages past `request`'s hit that it could hit."""
        tokens = request.token_ids
        for other in running:
            if other.cache_salt != request.cache_salt or other.num_uncomputed_tokens <= 1:
                continue
            theirs = other.prompt_token_ids
            shared = hit.num_tokens // page_size * page_size
            limit = min(len(tokens) - 1, len(theirs)) // page_size * page_size
            while (
                shared < limit and tokens[shared : shared + page_size] == theirs[shared : shared + page_size]
            ):
                shared += page_size
            if shared > hit.num_tokens and other.num_computed_tokens < shared:
                return True
        return False

    def store(self, request: KVRequest, num_tokens: int, kind: SnapshotKind) -> bool:
        """Keep the running request's state after `num_tokens` tokens; whether one was stored."""
        return False

    def release(self, request_id: str) -> None:
        """The request stopped running."""

    def rewind(self, request_id: str, num_positions: int) -> None:
        """A speculative chunk ran: keep what the request holds after its first `num_positions` positions."""

    def can_hold(self, num_pins: int) -> bool:
        """Whether `num_pins` more pins can each hold what this kind keeps at a pinned prefix's end."""
        return True

    def has(self, tokens: Sequence[int], salt: Salt) -> bool:
        """Whether the state after exactly `tokens` is kept (a plain transformer needs none)."""
        return True

    def hold(self, tokens: Sequence[int], salt: Salt) -> int | None:
        """Hold the state after exactly `tokens` for a pin; its slot, or None when none is held."""
        return None

    def unhold(self, slot: int) -> None:
        """A pin let go of the state it held in `slot`."""

    def check(self, request_ids: Collection[str], held_slots: Collection[int] = ()) -> None:
        """Raise AssertionError unless exactly `request_ids` hold what this kind holds per request, and
        `held_slots` (one per pin holding one) is what the pins hold."""
        assert not held_slots, "a plain transformer's pins hold no state"


class RecurrentStates(NoStates):
    """A hybrid's state slots: one running state per request with pages, the rest snapshots (`StateIndex`:
    each conversation's newest prompt end and turn end kept live, superseded ones and turn ends going first)."""

    enabled = True
    copies_partials = True  # the page a snapshot's position falls in stays cached for all who resume there

    def __init__(self, num_slots: int, mover: StateMover | None = None) -> None:
        """`mover` copies and resets the state tensors (None: books only)."""
        self.index: StateIndex = StateIndex(num_slots)
        self._mover = mover

    def min_partial_copy(self, page_size: int) -> int:
        """Any partial page is worth copying: a snapshot needs the KV of every token before it."""
        return 1

    def resume(self, tokens: Sequence[int], salt: Salt, hit: Hit, page_hit: PageHit) -> Hit:
        """The deepest snapshot at or before the pages' match, with the pages cut back to it; no hit (only
        where the request leaves the tree, `branch_tokens`) when no snapshot lies there."""
        snapshot = self.index.deepest(tokens, salt, hit.num_tokens)
        if snapshot is None:
            return Hit(branch_tokens=hit.num_tokens)
        branch = hit.num_tokens
        if snapshot.position < branch:
            hit = page_hit(tokens[: snapshot.position])
        assert hit.num_tokens == snapshot.position, "the pages before a snapshot are not all cached"
        return Hit(
            hit.pages, hit.partial, hit.num_tokens, hit.host_pages, snapshot.slot, branch, snapshot.kind
        )

    def can_start(self) -> bool:
        """Whether a slot is free or a snapshot can be dropped for one."""
        return self.index.can_take()

    def start(self, request_id: str, hit: Hit) -> None:
        """The request's running state: the hit's snapshot copied in, or zeros."""
        if hit.snapshot is not None:
            self.index.touch(hit.snapshot)  # first, so taking a slot drops another snapshot if it can
        slot = self.index.take(request_id, hit.snapshot)
        if self._mover is None:
            return
        if hit.snapshot is None:
            self._mover.reset_state(slot)
        elif hit.snapshot != slot:  # equal when the snapshot was the only slot to take: the state is there
            self._mover.copy_state(hit.snapshot, slot)

    def slots(self, request_ids: Collection[str]) -> dict[str, int]:
        """Each running request's state slot."""
        return {rid: self.index.slot(rid) for rid in request_ids}

    def first_unsnapshotted(self, tokens: Sequence[int], salt: Salt, points: Sequence[int]) -> int | None:
        """The first of these ascending positions with no snapshot of `tokens` yet: where a prefill is
        worth cutting to take one."""
        return next((p for p in points if not self.index.has(tokens[:p], salt)), None)

    def snapshot_point(
        self,
        request: PrefillRequest,
        span: tuple[int, int],
        branch_tokens: int,
        turn_tokens: int,
        others: Iterable[PrefillRequest],
    ) -> int | None:
        """The first point in (start, end] worth a snapshot with none there yet: where the request leaves the
        cached tree (`branch_tokens`) or stops sharing tokens with one of `others`. After a turn snapshot
        (`turn_tokens`: the end of the request's own previous turn), leaving the tree is no such point,
        and another must lie `MIN_SNAPSHOT_TOKENS` past it: a turn continuing its own history is not split for
        a snapshot nobody else would use (its own prompt end is snapshotted as the prefill finishes anyway)."""
        start, end = span
        tokens = request.token_ids
        # Past its own previous turn the tree holds that turn's history, re-rendered: leaving it there is no
        # branch another request will resume from.
        points = {branch_tokens} if not turn_tokens else set()
        for other in others:
            if other is not request and other.cache_salt == request.cache_salt:
                # The other resumes at most before its last token, which it computes to sample.
                points.add(min(common_prefix_length(tokens, other.token_ids), other.num_tokens - 1))
        floor = max(start, turn_tokens + MIN_SNAPSHOT_TOKENS - 1)
        candidates = sorted(p for p in points if floor < p <= end and p >= MIN_SNAPSHOT_TOKENS)
        return self.first_unsnapshotted(tokens, request.cache_salt, candidates)

    def computing(
        self, request: PrefillRequest, hit: Hit, running: Iterable[PrefillRequest], page_size: int
    ) -> bool:
        """Whether a running prefill shares more of the request's tokens than its hit and has not computed
        them yet: it cuts its prefill there and snapshots the state, so the request waits and resumes there."""
        limit = request.num_tokens - 1
        for other in running:
            if other.cache_salt != request.cache_salt or other.num_uncomputed_tokens <= 1:
                continue
            shared = min(common_prefix_length(request.token_ids, other.prompt_token_ids), limit)
            if (
                shared >= MIN_SNAPSHOT_TOKENS
                and shared > hit.num_tokens
                and other.num_computed_tokens < shared
            ):
                return True
        return False

    def store(self, request: KVRequest, num_tokens: int, kind: SnapshotKind) -> bool:
        """Keep the running request's state after `num_tokens` tokens (too short a prefix is not worth a
        slot); whether one was stored."""
        if num_tokens < MIN_SNAPSHOT_TOKENS:
            return False
        slot = self.index.store(request.token_ids[:num_tokens], request.cache_salt, kind, request.request_id)
        if slot is None:
            return False
        if self._mover is not None:
            self._mover.copy_state(self.index.slot(request.request_id), slot)
        return True

    def release(self, request_id: str) -> None:
        """The request's running slot is free again."""
        self.index.release(request_id)

    def rewind(self, request_id: str, num_positions: int) -> None:
        """The request's running state becomes the one after the chunk's first `num_positions` positions (its
        last token and the draft tokens accepted), kept per position while the chunk ran."""
        if self._mover is not None:
            self._mover.rewind(self.index.slot(request_id), num_positions)

    def can_hold(self, num_pins: int) -> bool:
        """Whether `num_pins` more pins can each hold a snapshot (they never hold the pool's last two slots)."""
        return self.index.can_hold(num_pins)

    def has(self, tokens: Sequence[int], salt: Salt) -> bool:
        """Whether the state after exactly `tokens` is kept."""
        return self.index.has(tokens, salt)

    def hold(self, tokens: Sequence[int], salt: Salt) -> int | None:
        """Hold the snapshot after exactly `tokens` for a pin, so nothing drops it; its slot, or None."""
        return self.index.hold(tokens, salt)

    def unhold(self, slot: int) -> None:
        """A pin let go of its snapshot: it is dropped in its turn, like any other."""
        self.index.unhold(slot)

    def check(self, request_ids: Collection[str], held_slots: Collection[int] = ()) -> None:
        """Raise AssertionError unless exactly `request_ids` hold a running slot, the pins' `held_slots`
        are the held snapshots, and the slots add up."""
        self.index.check(set(request_ids), Counter(held_slots))
