"""Pins: prefixes whose KV pages eviction may not take, until a TTL runs out or the pin is deleted.

A pin is made in two moves. `add` records it (after `check`) and the caller queues a `PinPrefill`, a
one-token prefill of `prefill_prompt` under the pin's id (so a cold prefix is computed like any prompt,
batched with the rest); when that request ends, its kind has `hold` make the KV manager hold the prefix's
cached full pages (an abort or a failure drops the pin instead). The cap is checked
on the prefix's size before anything runs, and pins never hold more than `max_bytes` between them.

On a hybrid a hit resumes only where a recurrent-state snapshot is kept, so a pin also holds the snapshot at
its pages' end, and its bytes count against the cap. Its prefill computes the whole pages alone, whose end
its prompt's end snapshot then is. When those pages and that snapshot are cached already, nothing is queued
and `hold` runs at once: a prefill would resume only before its last token, from an earlier snapshot or none,
and compute the prefix all over again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.sequence import Sequence
from swarmkv.core.stats import EngineCounters
from swarmkv.errors import InvalidRequestError, PinLimitError
from swarmkv.kv import KVCacheManager
from swarmkv.kv.retention import GROUP_SEP


@dataclass(frozen=True)
class PinInfo:
    """A pin as callers see it: the tokens and KV bytes it holds, and the seconds left (None: no TTL)."""

    pin_id: str
    num_tokens: int
    kv_bytes: int  # its pages', and a hybrid's state snapshot's
    expires_in_s: float | None
    ready: bool  # False while its prefix is still being computed
    num_cached_tokens: int = 0  # of its prefix, found in the prefix cache when its prefill ran
    holders: int = 1  # the requests that pinned it (`Pins.share`)
    # Prefix tokens its prefill computed and cached: its held pages' and a partial last page's (cached, unpinned),
    # none when the prefix was cached already. Anthropic's cache creation for the mark that made it.
    num_created_tokens: int = 0


PIN_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


@dataclass(eq=False)
class PinPrefill(Sequence):
    """A pin's prefill, a kind of request: its work counts under the `pin_` counters, its one token is no
    reply, and its end holds the prefix's pages (or, aborted or failed, drops the pin)."""

    pins: Pins | None = field(default=None, kw_only=True, repr=False)
    replies: ClassVar[bool] = False

    def count_hit(self, counters: EngineCounters, num_tokens: int) -> None:
        """Count cached prefix positions under the pin counters."""
        counters.pin_prefix_hit_tokens += num_tokens
        counters.pin_prompt_tokens += num_tokens

    def count_work(self, counters: EngineCounters, num_recomputed: int, num_first_prompt: int) -> None:
        """Count computed prefix positions under the pin counters."""
        counters.pin_recomputed_tokens += num_recomputed
        counters.pin_prompt_tokens += num_first_prompt
        counters.pin_prefill_tokens_computed += num_recomputed + num_first_prompt

    def count_generated(self, counters: EngineCounters, num_tokens: int) -> None:
        """A pin's token is dropped: nothing counts."""

    def ended(self) -> None:
        """Hold the prefix's cached pages; an aborted or failed prefill drops the pin."""
        assert self.pins is not None
        if self.finish_reason in ("abort", "error"):
            self.pins.remove(self.request_id)
        else:
            self.pins.hold(self.request_id, self.num_cached_tokens)


@dataclass
class _Pin:
    token_ids: list[int]
    cache_salt: str | None
    ttl_s: float | None
    expires_at: float | None = None  # monotonic seconds, set once held
    num_tokens: int = 0
    num_cached_tokens: int = 0
    num_created_tokens: int = 0
    ready: bool = False
    holders: int = 1


class Pins:
    """The engine's pins, over its KV manager."""

    def __init__(
        self,
        kv: KVCacheManager,
        page_bytes: int,
        max_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        state_bytes: int = 0,
    ) -> None:
        """`state_bytes`: what a hybrid's state snapshot holds (0 for a plain transformer)."""
        self.kv = kv
        self.page_bytes = page_bytes
        self.max_bytes = max_bytes
        self.state_bytes = state_bytes
        self._clock = clock
        self._pins: dict[str, _Pin] = {}

    def __contains__(self, pin_id: str) -> bool:
        return pin_id in self._pins

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def held_bytes(self) -> int:
        """KV bytes the held pins keep, a hybrid's state snapshots included (a page or snapshot two pins
        share counts once)."""
        return self.kv.num_pinned * self.page_bytes + self.kv.num_pinned_states * self.state_bytes

    def check(self, pin_id: str, token_ids: list[int], ttl_s: float | None) -> None:
        """Raise InvalidRequestError (PinLimitError past the cap) unless this pin can be added."""
        if pin_id in self._pins:
            raise InvalidRequestError(f"pin id {pin_id!r} is already in use")
        if ttl_s is not None and (
            isinstance(ttl_s, bool)
            or not isinstance(ttl_s, int | float)
            or not math.isfinite(ttl_s)
            or ttl_s <= 0
        ):
            raise InvalidRequestError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
        if len(token_ids) < self.kv.page_size:
            raise InvalidRequestError(
                f"a pin holds whole pages of {self.kv.page_size} tokens; this prefix has {len(token_ids)}"
            )
        in_flight = [p for p in self._pins.values() if not p.ready]
        pending = sum(len(p.token_ids) // self.kv.page_size for p in in_flight)
        wanted = (len(token_ids) // self.kv.page_size + pending) * self.page_bytes
        if self.kv.takes_snapshots:  # each holds a snapshot too
            wanted += (len(in_flight) + 1) * self.state_bytes
            if not self.kv.states.can_hold(len(in_flight) + 1):
                raise PinLimitError(
                    "every state slot a pin may hold is held: pins leave a hybrid's state pool two "
                    "slots, one for a running request and one for a snapshot"
                )
        if self.held_bytes + wanted > self.max_bytes:
            raise PinLimitError(
                f"pinning {len(token_ids)} tokens ({wanted:,} bytes with pins in progress) would hold more "
                f"than max_pinned_memory allows: {self.held_bytes:,} of {self.max_bytes:,} bytes are pinned"
            )

    def group_bytes(self, group: str) -> int:
        """KV bytes the pins with an id `GROUP\\0...` hold, or will once computed (their whole pages, a page
        two of them share counted twice), a hybrid's snapshots included."""
        prefix = group + GROUP_SEP
        total = 0
        for pin_id, pin in self._pins.items():
            if pin_id.startswith(prefix):
                pages = (
                    len(self.kv.pinned_pages(pin_id))
                    if pin.ready
                    else len(pin.token_ids) // self.kv.page_size
                )
                total += pages * self.page_bytes + (self.state_bytes if self.kv.takes_snapshots else 0)
        return total

    def check_share(self, group: str, num_tokens: int, share_bytes: int) -> None:
        """Raise PinLimitError unless `group`'s pins stay within `share_bytes` with one of `num_tokens` more."""
        held = self.group_bytes(group)
        wanted = num_tokens // self.kv.page_size * self.page_bytes
        if self.kv.takes_snapshots:
            wanted += self.state_bytes
        if held + wanted > share_bytes:
            raise PinLimitError(
                f"pinning {num_tokens} tokens ({wanted:,} bytes) would pass this tenant's share of "
                f"max_pinned_memory: {held:,} of its {share_bytes:,} bytes are pinned"
            )

    def prefill_prompt(self, token_ids: list[int], cache_salt: str | None) -> list[int] | None:
        """What a new pin's prefill computes: the prefix; on a hybrid its whole pages, so that a snapshot is
        taken at their end, or None when they and that snapshot are cached already (`hold` it at once)."""
        if not self.kv.takes_snapshots:
            return list(token_ids)
        if self.kv.pin_is_cached(token_ids, cache_salt):
            return None
        return list(token_ids[: len(token_ids) // self.kv.page_size * self.kv.page_size])

    def add(self, pin_id: str, token_ids: list[int], ttl_s: float | None, cache_salt: str | None) -> None:
        """Record a checked pin whose prefix is being computed (or is cached: `hold` it now)."""
        self._pins[pin_id] = _Pin(list(token_ids), cache_salt, ttl_s)

    def share(self, pin_id: str, ttl_s: float | None) -> None:
        """One more holder of a pin, held or still computing: it expires at the later of its own expiry and
        `ttl_s` from now (no TTL, on either side, holds it until it is deleted)."""
        pin = self._pins[pin_id]
        pin.holders += 1
        if not pin.ready:
            pin.ttl_s = None if ttl_s is None or pin.ttl_s is None else max(pin.ttl_s, ttl_s)
        elif pin.expires_at is not None:
            pin.expires_at = None if ttl_s is None else max(pin.expires_at, self._clock() + ttl_s)

    def hold(self, pin_id: str, num_cached_tokens: int) -> None:
        """The pin's prefill finished (`num_cached_tokens` of its prefix were found cached): hold its cached
        pages, within the cap (a pin past it holds fewer)."""
        pin = self._pins[pin_id]
        # A prefill computes its last token again even when all of it is cached: a page found is whole.
        size = self.kv.page_size
        pin.num_cached_tokens = -(-num_cached_tokens // size) * size
        computed = len(pin.token_ids) if not self.kv.takes_snapshots else len(pin.token_ids) // size * size
        pin.num_created_tokens = max(0, computed - pin.num_cached_tokens)
        pin.num_tokens = self.kv.pin(pin_id, pin.token_ids, pin.cache_salt)
        while self.held_bytes > self.max_bytes and pin.num_tokens:  # pages evicted and recomputed meanwhile
            self.kv.unpin(pin_id)
            pin.token_ids = pin.token_ids[: pin.num_tokens - self.kv.page_size]
            pin.num_tokens = self.kv.pin(pin_id, pin.token_ids, pin.cache_salt)
        pin.ready = True
        pin.expires_at = None if pin.ttl_s is None else self._clock() + pin.ttl_s

    def remove(self, pin_id: str) -> bool:
        """Drop a pin (its pages stay cached); False if unknown."""
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return False
        if pin.ready:
            self.kv.unpin(pin_id)
        return True

    def expire(self) -> list[str]:
        """Drop the pins whose TTL ran out; returns their ids."""
        now = self._clock()
        gone = [i for i, p in self._pins.items() if p.expires_at is not None and p.expires_at <= now]
        for pin_id in gone:
            self.remove(pin_id)
        return gone

    def info(self, pin_id: str) -> PinInfo | None:
        """The pin as callers see it, or None."""
        pin = self._pins.get(pin_id)
        if pin is None:
            return None
        left = None if pin.expires_at is None else max(0.0, pin.expires_at - self._clock())
        if not pin.ready and pin.ttl_s is not None:
            left = pin.ttl_s
        kv_bytes = len(self.kv.pinned_pages(pin_id)) * self.page_bytes
        if self.kv.pinned_state(pin_id) is not None:
            kv_bytes += self.state_bytes
        cached = min(pin.num_tokens, pin.num_cached_tokens)
        return PinInfo(
            pin_id, pin.num_tokens, kv_bytes, left, pin.ready, cached, pin.holders, pin.num_created_tokens
        )
