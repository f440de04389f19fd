"""Router: picks the replica for a request by its session, by the longest prefix routed there, or in turn.

Each replica's shadow index is an `EngineCore` (the engine's bookkeeping without tensors), as large as the
replica's own KV and with its retention policy: a routed request's prompt is prefilled there at once, under
its session, so the index holds what the replica caches and evicts it in the replica's own order. Recording at
once is what groups a cold swarm: its later requests, arriving before the first one has run, already match its
head and follow it to the same replica.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import count
from typing import Literal

from swarmkv.cluster.load_policy import Candidate, LoadThresholds, pick
from swarmkv.core.config import EngineConfig
from swarmkv.core.core import EngineCore
from swarmkv.kv import Hit, KVCacheManager, RetentionPolicy, pages_for

Policy = Literal["balanced", "prefix", "session", "round-robin"]
Reason = Literal["session", "prefix", "balance", "round_robin", "target", "replicate", "moved"]
POLICIES: tuple[Policy, ...] = ("balanced", "prefix", "session", "round-robin")
DEFAULT_MIN_MATCH = 128  # tokens: --route-min-match
DEFAULT_IMBALANCE = 8  # in-flight requests: --route-imbalance


@dataclass(frozen=True)
class RouteKey:
    """What the router reads of a request: its rendered prompt's token ids, cache salt and session."""

    tokens: Sequence[int]
    salt: str | None = None
    session: str | None = None


@dataclass(frozen=True)
class Decision:
    """Where a request goes, why, and how many of its tokens the router's index matched there."""

    replica: str
    reason: Reason
    matched_tokens: int


class Router:
    """One routing policy over the replicas it is given per request, with a bounded prefix index per replica."""

    def __init__(
        self,
        policy: Policy,
        *,
        pages_per_replica: int,
        page_size: int = 16,
        min_match: int = DEFAULT_MIN_MATCH,
        imbalance: int = DEFAULT_IMBALANCE,
        seed: int = 0,
        evict_ahead_pages: int = 0,
        retention: RetentionPolicy = EngineConfig.retention,
        thresholds: LoadThresholds | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`pages_per_replica` x `page_size` tokens is each replica's KV and `retention` its eviction policy;
        `min_match` (tokens) and `imbalance` (in-flight requests) gate the prefix policy; `seed` fixes the
        random choices; `evict_ahead_pages` (see `evict_ahead`) trades exact eviction order for fewer scans of
        a full index; `thresholds` are the balanced policy's (see `load_policy`); `clock` (seconds) is what the shadows'
        `return` retention times pauses by (a replay's own, so it repeats)."""
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; choose one of {', '.join(POLICIES)}")
        for name, value, least in (("pages_per_replica", pages_per_replica, 1), ("page_size", page_size, 1)):
            if value < least:
                raise ValueError(f"{name} must be at least {least}, got {value}")
        if min(min_match, imbalance, evict_ahead_pages) < 0:
            raise ValueError(
                f"min_match, imbalance and evict_ahead_pages must be >= 0, got {min_match}, {imbalance}"
                f" and {evict_ahead_pages}"
            )
        self.policy: Policy = policy
        self.pages_per_replica = pages_per_replica
        self.page_size = page_size
        self.min_match = min_match
        self.imbalance = imbalance
        self.evict_ahead_pages = evict_ahead_pages
        self.thresholds = thresholds or LoadThresholds()
        # The replica's settings where they shape its cache; every prompt prefills in one step here.
        self._shadow_config = EngineConfig(
            block_size=page_size, retention=retention, max_num_batched_tokens=1 << 30
        )
        self._clock = clock
        self._rng = random.Random(seed)
        self._indexes: dict[str, EngineCore] = {}
        self._sessions: dict[str, str] = {}  # session -> the replica it is bound to
        self._bound: Counter[str] = Counter()  # replica -> sessions bound to it
        self._decisions: Counter[tuple[str, str]] = Counter()
        self._routed: Counter[str] = Counter()  # replica -> requests routed there
        self._prefill: Counter[str] = Counter()  # replica -> prompt tokens routed there less those matched
        self._next_turn = 0  # round-robin's position
        self._request_ids = count()

    @property
    def decisions(self) -> Mapping[tuple[str, str], int]:
        """(policy, reason) -> decisions made so far (a copy)."""
        return dict(self._decisions)

    def cached_pages(self, replica: str) -> int:
        """Pages the router's index of `replica` holds (0 for a replica it never routed to)."""
        index = self._indexes.get(replica)
        return index.kv.num_cached if index is not None else 0

    def shadow(self, replica: str) -> EngineCore | None:
        """The router's engine core standing for `replica` (None before it routed there)."""
        return self._indexes.get(replica)

    def choose(
        self, key: RouteKey, loads: Mapping[str, int], queued_tokens: Mapping[str, float] | None = None
    ) -> Decision:
        """The replica for this request among `loads` (replica id -> in-flight requests, non-empty); records
        it: the tokens go into that replica's index, the session is bound there, the counter bumps.
        `queued_tokens` (replica id -> prefill tokens waiting there; none known: 0) weighs in the balanced
        policy only."""
        if not loads:
            raise ValueError("no replica to route to: loads is empty")
        candidates = sorted(loads)
        hits: dict[str, Hit] = {}
        reason: Reason
        if self.policy == "round-robin":
            replica, reason = candidates[self._next_turn % len(candidates)], "round_robin"
            self._next_turn += 1
        elif (
            self.policy == "session" and key.session is not None and self._sessions.get(key.session) in loads
        ):
            replica, reason = self._sessions[key.session], "session"
        elif self.policy == "balanced":
            hits = self._matches(key, candidates)
            queued = queued_tokens or {}
            running = self.thresholds.running_tokens
            options = [
                Candidate(
                    r,
                    queued.get(r, 0.0) + running * loads[r],
                    hits[r].num_tokens if r in hits else 0,
                    self._routed[r],
                    self._bound[r],
                    self._prefill[r],
                )
                for r in candidates
            ]
            home = self._sessions.get(key.session) if key.session is not None else None
            new_session = key.session is not None and home is None
            replica, reason = pick(options, len(key.tokens), home, self.thresholds, new_session)
        elif self.policy == "prefix":
            hits = self._matches(key, candidates)
            best = min(hits, key=lambda r: (-hits[r].num_tokens, loads[r], r), default=None)
            least = min(loads.values())
            if best is not None and loads[best] <= least + self.imbalance:
                replica, reason = best, "prefix"
            else:
                replica, reason = self._balance(loads, candidates), "balance"
        else:
            replica, reason = self._balance(loads, candidates), "balance"
        matched = self._record(replica, key, hits.get(replica))
        if key.session is not None:
            self._bind(key.session, replica)
        self._decisions[(self.policy, reason)] += 1
        self._routed[replica] += 1
        self._prefill[replica] += len(key.tokens) - matched
        return Decision(replica, reason, matched)

    def forget(self, replica: str) -> None:
        """A replica died or left: drop its index and the sessions bound to it."""
        self._indexes.pop(replica, None)
        self._sessions = {s: r for s, r in self._sessions.items() if r != replica}
        self._bound.pop(replica, None)
        self._prefill.pop(replica, None)

    def _bind(self, session: str, replica: str) -> None:
        before = self._sessions.get(session)
        if before != replica:
            if before is not None:
                self._bound[before] -= 1
            self._bound[replica] += 1
            self._sessions[session] = replica

    def _matches(self, key: RouteKey, candidates: list[str]) -> dict[str, Hit]:
        """The candidates whose index matches at least `min_match` tokens of the key, with their hits."""
        # Probing the first page first skips, at the cost of one page's walk, every replica that cannot
        # reach min_match: a match shorter than a page cannot grow past that page.
        probe = key.tokens[: self.page_size]
        need_probe = min(self.min_match, len(probe))
        hits: dict[str, Hit] = {}
        for replica in candidates:
            core = self._indexes.get(replica)
            if core is None:
                if self.min_match == 0:
                    hits[replica] = Hit()
                continue
            index = core.kv
            if need_probe and index.lookup(probe, key.salt).num_tokens < need_probe:
                continue
            hit = index.lookup(key.tokens, key.salt)
            if hit.num_tokens >= self.min_match:
                hits[replica] = hit
        return hits

    def _balance(self, loads: Mapping[str, int], candidates: list[str]) -> str:
        """Power of two choices: the less loaded of two random candidates (ties: the lower id)."""
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return min((loads[a], a), (loads[b], b))[1]

    def _record(self, replica: str, key: RouteKey, hit: Hit | None) -> int:
        """Prefill the key's prompt in the replica's shadow core, as the replica will cache it, under its
        session; the tokens its index matched before (`hit`: that match, when the caller looked it up)."""
        core = self._indexes.get(replica)
        if core is None:
            core = self._indexes[replica] = EngineCore(
                self._shadow_config, self.pages_per_replica, clock=self._clock
            )
        # The replica refuses a prompt the pool cannot hold with a reply: record the most of it that fits.
        tokens = list(key.tokens[: self.pages_per_replica * self.page_size - 1])
        if (
            evict_ahead(core.kv, tokens, key.salt, self.evict_ahead_pages)
            or hit is None
            or len(tokens) < len(key.tokens)
        ):
            hit = core.kv.lookup(tokens, key.salt)
        matched = hit.num_tokens
        session = key.session
        if session is not None and not core.valid_session_id(session):
            session = None  # the replica refuses such a request: it caches nothing under that session
        while tokens:
            seq = core.prefill(f"route-{next(self._request_ids)}", tokens, key.salt, session)
            if seq is not None:
                break
            tokens = tokens[: max(0, len(tokens) - self.page_size)]  # a partial page to copy needs one more
        return matched


def evict_ahead(manager: KVCacheManager, tokens: Sequence[int], salt: str | None, ahead_pages: int) -> bool:
    """Before a request for `tokens` when `ahead_pages` > 0: if the pool might run short of free pages for it,
    evict that shortfall plus `ahead_pages` least recently used pages now, sparing the cached prefix of
    `tokens`, so the eviction scan of the whole index runs once per `ahead_pages` pages rather than once per
    request (an engine's free-page watermark). Whether it evicted; a lookup made before is then stale."""
    need = pages_for(len(tokens), manager.page_size) + 1  # the most a request's allocation takes
    if ahead_pages == 0 or manager.num_free >= need:
        return False
    pin = "evict-ahead"  # held only within this call: the prefix it holds stays cached, never evicted here
    manager.pin(pin, tokens, salt)
    manager.evict(need - manager.num_free + ahead_pages)
    manager.unpin(pin)
    return True
