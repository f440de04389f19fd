"""Sessions: an agent's turns, the newest of each open session, and the cap on how many stay open.

This is the one place a session is opened or released. The KV manager's `Retention` reads the same events
to rank pages for eviction; the engine and the tools that replay requests without a model go through here.
"""

from __future__ import annotations

from collections.abc import Container

from swarmkv.core.sequence import Sequence
from swarmkv.errors import InvalidRequestError
from swarmkv.kv import KVCacheManager
from swarmkv.prefix import common_prefix_length


class Sessions:
    """Each open session's newest turn, oldest activity first; at most `max_open` are kept open."""

    def __init__(self, kv: KVCacheManager, max_open: int, max_id_chars: int) -> None:
        self.kv = kv
        self.max_open = max_open
        self.max_id_chars = max_id_chars
        self._newest: dict[str, Sequence] = {}  # in order of last turn

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._newest

    def __len__(self) -> int:
        return len(self._newest)

    def is_valid_id(self, session_id: object) -> bool:
        """Whether `session_id` is a usable session id: a non-empty string, not too long."""
        return isinstance(session_id, str) and 0 < len(session_id) <= self.max_id_chars

    def check_id(self, session_id: object) -> None:
        """Raise InvalidRequestError unless `session_id` is a usable session id."""
        if not self.is_valid_id(session_id):
            raise InvalidRequestError(
                f"a session id is a non-empty string of at most {self.max_id_chars} characters"
            )

    def open_turn(self, seq: Sequence, is_live: Container[str]) -> None:
        """Make `seq` its session's newest turn. The positions the previous turn processed and this one
        repeats count as the session's own: computing them again is recomputation, not new prompt. Past the
        cap, the session idle longest (no request in `is_live`) is released."""
        session_id = seq.session_id
        assert session_id is not None
        previous = self._newest.pop(session_id, None)
        if previous is not None:
            common = common_prefix_length(previous.token_ids, seq.prompt_token_ids)
            seq.num_processed_tokens = min(
                common, previous.num_processed_tokens, len(seq.prompt_token_ids) - 1
            )
        self._newest[session_id] = seq
        self.kv.open_turn(seq)
        if len(self._newest) > self.max_open:  # clients that never release: end the longest idle
            idle = next(
                (
                    sid
                    for sid, last in self._newest.items()
                    if sid != session_id and last.request_id not in is_live
                ),
                None,
            )
            if idle is not None:
                self.release(idle)

    def release(self, session_id: str) -> bool:
        """End a session: its private pages become the first to be evicted. False if it is not open."""
        self._newest.pop(session_id, None)
        return self.kv.release_session(session_id)
