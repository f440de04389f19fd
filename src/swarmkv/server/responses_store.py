"""ResponseStore: the stored Responses API responses that `previous_response_id` continues, bounded by count and age."""

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


class ResponseStore:
    """Responses by id, oldest evicted first past `max_responses`, any older than `max_age_s` expired."""

    def __init__(
        self,
        max_responses: int,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_responses < 0:
            raise ValueError(f"max_responses must be at least 0, got {max_responses}")
        self.max_responses = max_responses
        self.max_age_s = max_age_s
        self._clock = clock
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self._newest: dict[str, str] = {}  # session id -> id of its chain's newest stored response

    def __len__(self) -> int:
        return len(self._responses)

    def now_s(self) -> float:
        """The store's clock, for `StoredResponse.stored_at_s`."""
        return self._clock()

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response, unless it is unknown, evicted or expired."""
        self._expire()
        return self._responses.get(response_id)

    def put(self, response_id: str, stored: StoredResponse) -> None:
        """Store a response as its chain's newest, evicting the oldest past the count limit."""
        self._expire()
        self._responses[response_id] = stored
        self._newest[stored.session_id] = response_id
        while len(self._responses) > self.max_responses:
            self._drop(next(iter(self._responses)))

    def delete(self, response_id: str) -> tuple[StoredResponse, bool] | None:
        """Remove a response; it and whether it was its chain's newest, or None if unknown."""
        stored = self.get(response_id)
        if stored is None:
            return None
        was_newest = self._newest.get(stored.session_id) == response_id
        self._drop(response_id)
        return stored, was_newest

    def _expire(self) -> None:
        oldest_kept_s = self._clock() - self.max_age_s
        # Insertion order is age order, so expiry stops at the first young one.
        while self._responses:
            response_id, stored = next(iter(self._responses.items()))
            if stored.stored_at_s >= oldest_kept_s:
                break
            self._drop(response_id)

    def _drop(self, response_id: str) -> None:
        stored = self._responses.pop(response_id)
        if self._newest.get(stored.session_id) == response_id:
            del self._newest[stored.session_id]
