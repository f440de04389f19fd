"""Recurrent-state slots of a hybrid model, no tensors: one per running request, the rest hold snapshots.

A Gated DeltaNet layer keeps a fixed-size state per sequence instead of KV, so a prefix hit needs the state
at the hit's end: a snapshot, taken where one pays (see `KVCacheManager.snapshot`). A snapshot is keyed by
the exact tokens before it (under the request's salt), so it is found at any position, with no alignment to
pages. Slots form one pool: a request that starts running takes a free slot, or a snapshot's; a new snapshot
takes a free slot or another snapshot's, never a running request's. A pin holds the snapshot at its prefix's end
(`hold`): no request or snapshot takes a held one, and holds never reach the pool's last two slots (one
running, one snapshot: the least a pool works with).

A conversation is a lineage: a request that resumes from a lineage's prompt or turn snapshot continues it (unless
another running request already does: a fork starts its own), any other starts one. Its prompt snapshot
supersedes the lineage's earlier ones, its turn snapshot the lineage's earlier turn, so a lineage keeps at most
its newest prompt end and turn end live. Which snapshot's slot goes when one is needed: a superseded one first,
then a turn end (its next turn resumes there only when the reply renders back to the sampled ids; the prompt end
before it serves either way), then the least recently used.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from swarmkv.kv.radix_index import Salt

# Snapshots are taken at positions of at least this many tokens: a shorter prefix costs a whole state slot
# to spare little compute.
MIN_SNAPSHOT_TOKENS = 32

# "prompt": the state after a prompt's last token, taken as its prefill's last chunk finishes (committed positions
# only); the next turn always continues it, however the reply renders back. "turn": where a request stopped (its
# reply's end, or a preemption), which its next turn continues only when the reply renders back to the tokens
# sampled. "branch": a point where requests part (a branch of the tree, a cold swarm's common head, a pinned
# prefix), which others resume from.
SnapshotKind = Literal["prompt", "turn", "branch"]


class StateMover(Protocol):
    """Copies recurrent state between slots; the KV manager calls it as it changes its books."""

    def copy_state(self, src: int, dst: int) -> None:
        """Copy every linear-attention layer's state of slot `src` into slot `dst`."""

    def reset_state(self, slot: int) -> None:
        """Zero slot `slot`: the state before any token."""

    def rewind(self, slot: int, num_positions: int) -> None:
        """Set slot `slot` to the state after the first `num_positions` positions of its speculative chunk."""


@dataclass
class Snapshot:
    """The state after `len(key)` tokens: in `slot`, for requests of `salt` whose tokens begin with `key`."""

    slot: int
    salt: Salt
    key: tuple[int, ...]
    last_access: int
    kind: SnapshotKind = "branch"
    lineage: int | None = None  # prompt and turn snapshots: the conversation whose end it is
    superseded: bool = False  # its lineage has moved past it: the first to go

    @property
    def drop_rank(self) -> tuple[bool, bool, int]:
        """Snapshots go in this order, lowest first: superseded, turn ends, then least recently used."""
        return (not self.superseded, self.kind != "turn", self.last_access)

    @property
    def position(self) -> int:
        """Tokens the state has seen."""
        return len(self.key)


@dataclass
class StateCounters:
    """Snapshot traffic since start."""

    stores: int = 0
    hits: int = 0  # requests that resumed from a snapshot
    drops: int = 0  # snapshots whose slot went to a running request or a newer snapshot
    superseded: int = 0  # prompt and turn snapshots their lineage moved past


class StateIndex:
    """A fixed pool of state slots: running requests' states and snapshots, LRU among snapshots."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 2:
            raise ValueError(
                f"a state pool needs at least 2 slots (one running, one snapshot), got {num_slots}"
            )
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._running: dict[str, int] = {}
        self._lineages: dict[str, int] = {}  # running request -> the lineage it continues (one each)
        self._new_lineage = itertools.count()
        self._snapshots: dict[tuple[Salt, tuple[int, ...]], Snapshot] = {}
        self._by_slot: dict[int, Snapshot] = {}
        self._positions: dict[Salt, Counter[int]] = {}
        self._holds: Counter[int] = Counter()  # slot -> pins holding its snapshot
        self._clock = itertools.count(1)
        self.counters = StateCounters()

    @property
    def num_running(self) -> int:
        """Slots held by running requests."""
        return len(self._running)

    @property
    def num_snapshots(self) -> int:
        """Slots holding snapshots."""
        return len(self._snapshots)

    @property
    def num_held(self) -> int:
        """Snapshots some pin holds."""
        return len(self._holds)

    def count(self, kind: SnapshotKind) -> int:
        """Snapshots of one kind."""
        return sum(1 for s in self._snapshots.values() if s.kind == kind)

    @property
    def num_free(self) -> int:
        """Slots holding nothing."""
        return len(self._free)

    def slot(self, request_id: str) -> int:
        """The running request's slot."""
        return self._running[request_id]

    def can_take(self) -> bool:
        """Whether `take` would succeed: a free slot, or a snapshot no pin holds to drop for one."""
        return bool(self._free) or len(self._snapshots) > len(self._holds)

    def take(self, request_id: str, resumed: int | None = None) -> int:
        """A slot for a request that starts running, from the snapshot in slot `resumed` if any (dropping a
        snapshot if no slot is free); `can_take` must have said yes."""
        assert request_id not in self._running, f"{request_id} already holds a state slot"
        # Before a drop, which may take the very snapshot it resumes from.
        continued = self._continued(resumed)
        self._lineages[request_id] = next(self._new_lineage) if continued is None else continued
        slot = self._free.pop() if self._free else self._drop()
        self._running[request_id] = slot
        return slot

    def _continued(self, resumed: int | None) -> int | None:
        """The lineage a request resuming from the snapshot in slot `resumed` continues: that snapshot's, unless
        it is a branch, superseded, or continued by another running request already."""
        snapshot = self._by_slot.get(resumed) if resumed is not None else None
        if snapshot is None or snapshot.lineage is None or snapshot.superseded:
            return None
        return None if snapshot.lineage in self._lineages.values() else snapshot.lineage

    def lineage(self, request_id: str) -> int:
        """The lineage the running request continues."""
        return self._lineages[request_id]

    def release(self, request_id: str) -> None:
        """The request stopped running: its slot is free (snapshot it first to keep its state)."""
        self._free.append(self._running.pop(request_id))
        del self._lineages[request_id]

    def deepest(self, tokens: Sequence[int], salt: Salt, limit: int) -> Snapshot | None:
        """The snapshot furthest into `tokens` at a position of at most `limit`. Changes nothing."""
        positions = self._positions.get(salt)
        if not positions:
            return None
        for position in sorted((p for p in positions if p <= limit), reverse=True):
            snapshot = self._snapshots.get((salt, tuple(tokens[:position])))
            if snapshot is not None:
                return snapshot
        return None

    def has(self, tokens: Sequence[int], salt: Salt) -> bool:
        """Whether the state after exactly `tokens` is kept."""
        return (salt, tuple(tokens)) in self._snapshots

    def snapshot(self, tokens: Sequence[int], salt: Salt) -> Snapshot | None:
        """The snapshot of the state after exactly `tokens`, if kept. Changes nothing."""
        return self._snapshots.get((salt, tuple(tokens)))

    def touch(self, slot: int) -> None:
        """A request resumed from the snapshot in `slot`."""
        self._by_slot[slot].last_access = next(self._clock)
        self.counters.hits += 1

    def store(
        self, tokens: Sequence[int], salt: Salt, kind: SnapshotKind, request_id: str | None = None
    ) -> int | None:
        """A slot to copy the state after `tokens` into, now keyed by them: a free slot or the first snapshot to
        go. None when that state is kept already (it is touched) or no slot can be had. A prompt or turn
        snapshot belongs to the lineage of `request_id`, the running request whose state it is, and supersedes
        that lineage's earlier ones."""
        key = (salt, tuple(tokens))
        lineage = self._lineages[request_id] if kind != "branch" and request_id is not None else None
        kept = self._snapshots.get(key)
        if kept is not None:
            kept.last_access = next(self._clock)
            if lineage is not None and kept.kind != "branch":
                kept.kind = "prompt" if "prompt" in (kept.kind, kind) else kind
                kept.lineage, kept.superseded = lineage, False
                self._supersede(kept)
            return None
        if not self.can_take():
            return None
        slot = self._free.pop() if self._free else self._drop()
        kind = kind if lineage is not None else "branch"
        snapshot = self._snapshots[key] = Snapshot(slot, salt, key[1], next(self._clock), kind, lineage)
        self._by_slot[slot] = snapshot
        self._positions.setdefault(salt, Counter())[len(tokens)] += 1
        self.counters.stores += 1
        self._supersede(snapshot)
        return slot

    def _supersede(self, newest: Snapshot) -> None:
        """`newest` is its lineage's newest prompt end (every earlier snapshot of the lineage is passed) or
        turn end (the lineage's earlier turn ends are)."""
        for snapshot in self._snapshots.values():
            if (
                snapshot is not newest
                and snapshot.lineage == newest.lineage
                and not snapshot.superseded
                and (newest.kind == "prompt" or snapshot.kind == "turn")
            ):
                snapshot.superseded = True
                self.counters.superseded += 1

    def can_hold(self, num_more: int = 1) -> bool:
        """Whether pins may hold `num_more` more snapshots: holds leave the pool's last two slots alone."""
        return len(self._holds) + num_more <= self.num_slots - 2

    def hold(self, tokens: Sequence[int], salt: Salt) -> int | None:
        """Hold the snapshot after exactly `tokens` for a pin, so nothing drops it until `unhold`; its slot, or
        None if no such snapshot is kept or no more may be held. A held snapshot is where other requests
        resume, so it counts as a branch from now on."""
        snapshot = self._snapshots.get((salt, tuple(tokens)))
        if snapshot is None or (snapshot.slot not in self._holds and not self.can_hold()):
            return None
        snapshot.kind, snapshot.lineage, snapshot.superseded = "branch", None, False
        snapshot.last_access = next(self._clock)
        self._holds[snapshot.slot] += 1
        return snapshot.slot

    def unhold(self, slot: int) -> None:
        """A pin let go of the snapshot in `slot`: once no pin holds it, it is dropped like any other."""
        assert self._holds[slot] > 0, f"slot {slot} holds no pinned snapshot"
        self._holds[slot] -= 1
        if not self._holds[slot]:
            del self._holds[slot]

    def _drop(self) -> int:
        """Free the slot of the first unheld snapshot to go (`Snapshot.drop_rank`)."""
        unheld = ((key, s) for key, s in self._snapshots.items() if s.slot not in self._holds)
        key, snapshot = min(unheld, key=lambda item: item[1].drop_rank)
        del self._snapshots[key]
        del self._by_slot[snapshot.slot]
        positions = self._positions[snapshot.salt]
        positions[snapshot.position] -= 1
        if not positions[snapshot.position]:
            del positions[snapshot.position]
            if not positions:
                del self._positions[snapshot.salt]
        self.counters.drops += 1
        return snapshot.slot

    def check(self, running: set[str], held: Counter[int] | None = None) -> None:
        """Raise AssertionError unless every slot is free, running or a snapshot exactly once, exactly
        the requests in `running` hold slots and, given `held` (slot -> pins holding it), the pins' holds."""
        assert set(self._running) == running, (
            f"state slots held by {sorted(set(self._running) ^ running)} disagree with the page tables"
        )
        slots = self._free + list(self._running.values()) + [s.slot for s in self._snapshots.values()]
        assert sorted(slots) == list(range(self.num_slots)), "a state slot is lost or used twice"
        counted = Counter((s.salt, s.position) for s in self._snapshots.values())
        indexed = Counter({(salt, p): n for salt, ps in self._positions.items() for p, n in ps.items()})
        assert counted == indexed, "snapshot positions disagree with the snapshots"
        assert {s.slot: s for s in self._snapshots.values()} == self._by_slot, "snapshot slot map is stale"
        assert all(slot in self._by_slot and n > 0 for slot, n in self._holds.items()), (
            "a hold lost its snapshot"
        )
        assert held is None or held == self._holds, "the pins' snapshots disagree with the held ones"
        assert len(self._holds) <= max(0, self.num_slots - 2), "pins hold the pool's last slots"
        assert self._lineages.keys() == self._running.keys(), "a running request has no lineage"
        assert len(set(self._lineages.values())) == len(self._lineages), (
            "two running requests share a lineage"
        )
        live: Counter[tuple[int | None, SnapshotKind]] = Counter()
        for s in self._snapshots.values():
            assert (s.kind == "branch") == (s.lineage is None), f"slot {s.slot}: a {s.kind} of {s.lineage}"
            assert not (s.superseded and s.slot in self._holds), f"slot {s.slot}: held but superseded"
            live[s.lineage, s.kind] += not s.superseded
        assert all(n <= 1 for (lineage, _), n in live.items() if lineage is not None), (
            "a lineage keeps more than its newest prompt end and turn end live"
        )
