"""Which session (agent) a logged request belongs to: its session id, else its `user`, else continuity.

Continuity: a request whose tokens continue an earlier, shorter prompt belongs to that prompt's session;
failing that (a break, such as a timestamp in the system prompt, stops the tokens matching), one whose
conversation (its messages after the system ones) continues an earlier request's belongs to its session.
Otherwise it starts a session of its own, named `auto-N`.
"""

from __future__ import annotations

import json
from typing import Any


class Sessions:
    """Session names of the requests seen so far, and each session's newest request."""

    def __init__(self) -> None:
        self._conversations: dict[int, str] = {}  # hash of a conversation -> its newest session
        self._newest: dict[str, int] = {}
        self._num_auto = 0

    def assign(
        self, session_id: str | None, user: str | None, messages: list[dict[str, Any]], continues: str | None
    ) -> str:
        """The session of a new request; `continues` is the session of the earlier prompt it extends."""
        if session_id is not None:
            return session_id
        if user is not None:
            return f"user:{user}"
        if continues is not None:
            return continues
        hashes = _conversation_hashes(messages)
        for h in reversed(hashes[:-1]):  # proper prefixes, longest first
            if h in self._conversations:
                return self._conversations[h]
        self._num_auto += 1
        return f"auto-{self._num_auto}"

    def newest(self, session: str) -> int | None:
        """The index of the session's newest request, if it has one."""
        return self._newest.get(session)

    def remember(self, index: int, session: str, messages: list[dict[str, Any]]) -> None:
        """Record request `index` as its session's newest."""
        self._newest[session] = index
        hashes = _conversation_hashes(messages)
        if hashes:
            self._conversations[hashes[-1]] = session


def _conversation_hashes(messages: list[dict[str, Any]]) -> list[int]:
    """A hash of each prefix of the conversation (the messages after the leading system ones)."""
    start = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    hashes, h = [], 0
    for message in messages[start:]:
        h = hash((h, json.dumps(message, sort_keys=True, ensure_ascii=False)))
        hashes.append(h)
    return hashes
