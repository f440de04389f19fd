"""What the KV manager and its cache kinds read of a request, and the cache hit they hand each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from swarmkv.kv.radix_index import PartialHit, Salt
from swarmkv.kv.state_index import SnapshotKind


class KVRequest(Protocol):
    """What the manager reads of a request: its id, its salt, its tokens and how many have KV."""

    @property
    def request_id(self) -> str: ...

    @property
    def cache_salt(self) -> Salt: ...

    @property
    def token_ids(self) -> list[int]: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def session_id(self) -> str | None: ...


class PrefillRequest(KVRequest, Protocol):
    """What a cache kind reads of the requests whose prefills it weighs: their prompts and progress too."""

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_uncomputed_tokens(self) -> int: ...


@dataclass(frozen=True)
class Hit:
    """A cached prefix: full device pages, then full host pages to load, and possibly a partial page to
    continue in. Holds no references."""

    pages: tuple[int, ...] = ()
    partial: PartialHit | None = None
    num_tokens: int = 0
    host_pages: tuple[int, ...] = ()
    snapshot: int | None = None  # hybrids: the state slot to resume from, after num_tokens tokens
    branch_tokens: int = 0  # hybrids: tokens the cached pages match, where the request leaves the tree
    snapshot_kind: SnapshotKind | None = None  # hybrids: what the snapshot resumed from was taken at

    @property
    def turn_tokens(self) -> int:
        """Where the snapshot this hit resumes from ends when it is a conversation's own (its previous prompt's
        or turn's end); 0 if none."""
        return self.num_tokens if self.snapshot_kind in ("prompt", "turn") else 0

    @property
    def num_loads(self) -> int:
        """Host pages `allocate` copies back to the device for this hit."""
        return len(self.host_pages) + (self.partial is not None and self.partial.on_host)


NO_HIT = Hit()
