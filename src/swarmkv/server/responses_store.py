"""ResponseStore: the stored Responses API responses that `previous_response_id` continues, bounded by count and age.

Each response belongs to the tenant that made it (`tenants.py`): another tenant's id is unknown to it, and each
tenant has its own share of the count, so one tenant storing many responses evicts only its own.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_AGE_S = 3600.0  # an agent's turn gaps are seconds to minutes; an hour-old chain is abandoned


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: its object, the conversation up to and including its output, and its chain's session."""

    body: dict[str, Any]  # the response object GET /v1/responses/{id} returns
    items: list[dict[str, Any]]  # every input item of the chain, as resolved, then this response's output
    session_id: str  # the id of the chain's first response: one session for the whole chain
    stored_at_s: float
    tenant: str | None = None  # the name of the tenant that stored it (None: the one unnamed tenant)


class ResponseStore:
    """Responses by tenant and id, each tenant's oldest evicted first past its share of `max_responses`
    (`max_responses // num_tenants`, at least 1), any older than `max_age_s` expired."""

    def __init__(
        self,
        max_responses: int,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
        num_tenants: int = 1,
    ) -> None:
        if max_responses < 0:
            raise ValueError(f"max_responses must be at least 0, got {max_responses}")
        if num_tenants < 1:
            raise ValueError(f"num_tenants must be at least 1, got {num_tenants}")
        self.max_responses = max_responses
        self.share = max(1, max_responses // num_tenants) if max_responses else 0
        self.max_age_s = max_age_s
        self._clock = clock
        # tenant -> its responses by id, oldest first
        self._responses: dict[str | None, OrderedDict[str, StoredResponse]] = {}
        # (tenant, session id) -> id of its chain's newest stored response
        self._newest: dict[tuple[str | None, str], str] = {}

    def __len__(self) -> int:
        self._expire()
        return sum(len(responses) for responses in self._responses.values())

    def count(self, tenant: str | None) -> int:
        """How many responses `tenant` has stored."""
        self._expire()
        return len(self._responses.get(tenant, ()))

    def now_s(self) -> float:
        """The store's clock, for `StoredResponse.stored_at_s`."""
        return self._clock()

    def get(self, response_id: str, tenant: str | None) -> StoredResponse | None:
        """`tenant`'s stored response, unless it is unknown (or another tenant's), evicted or expired."""
        self._expire()
        responses = self._responses.get(tenant)
        return responses.get(response_id) if responses is not None else None

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Store a response as its chain's newest, evicting its tenant's oldest past the tenant's share."""
        tenant = stored.tenant
        self._expire()
        responses = self._responses.setdefault(tenant, OrderedDict())
        responses[response_id] = stored
        self._newest[tenant, stored.session_id] = response_id
        while len(responses) > self.share:
            self._drop(tenant, next(iter(responses)))

    def delete(self, response_id: str, tenant: str | None) -> tuple[StoredResponse, bool] | None:
        """Remove `tenant`'s response; it and whether it was its chain's newest, or None if unknown."""
        stored = self.get(response_id, tenant)
        if stored is None:
            return None
        was_newest = self._newest.get((tenant, stored.session_id)) == response_id
        self._drop(tenant, response_id)
        return stored, was_newest

    def _expire(self) -> None:
        oldest_kept_s = self._clock() - self.max_age_s
        for tenant in list(self._responses):
            responses = self._responses[tenant]
            # Insertion order is age order, so expiry stops at the first young one.
            while tenant in self._responses:
                response_id, stored = next(iter(responses.items()))
                if stored.stored_at_s >= oldest_kept_s:
                    break
                self._drop(tenant, response_id)

    def _drop(self, tenant: str | None, response_id: str) -> None:
        responses = self._responses[tenant]
        stored = responses.pop(response_id)
        if self._newest.get((tenant, stored.session_id)) == response_id:
            del self._newest[tenant, stored.session_id]
        if not responses:
            del self._responses[tenant]
