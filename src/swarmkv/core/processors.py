"""Per-request processors: the features that follow each request beside the core (a grammar, the loop guard,
drafts, seeded sampling, the text), all through one interface, so a new one is one class in a list.

A step calls the hooks in its order: `added` as a request is queued; `draft_limit` while the scheduler drafts;
`needs_ids` to decide whether the next step may be scheduled before this one's ids are read; `prepare` before the
forward (work that overlaps it) and `logits` after it; `forced` and `appended` inside `EngineCore.update`, the
one place tokens are committed; `ended` once a request finished, failed or was aborted. Every hook does
nothing by default, and a processor ignores the requests it does not track. No tensors here: the logits are the
executor's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarmkv.core.scheduler import Chunk
from swarmkv.core.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class LogitRows:
    """A step's logits as processors see them: each sampling chunk's `num_logits` rows, in order (a speculative
    chunk's row after each draft token too); `hidden`, the same rows' last hidden states, when a processor
    asked for them (`RequestProcessor.wants_hidden_states`) and the forward had them."""

    chunks: list[Chunk]
    logits: torch.Tensor
    hidden: torch.Tensor | None = None

    def first_rows(self) -> list[int]:
        """Each chunk's first row."""
        rows, first = [], 0
        for chunk in self.chunks:
            rows.append(first)
            first += chunk.num_logits
        return rows


@dataclass(frozen=True)
class Ending:
    """A processor ends a reply inside the tokens a step appended: the first `num_kept` of them stay."""

    num_kept: int
    reason: FinishReason


class RequestProcessor:
    """One per-request feature; a subclass overrides the hooks it needs."""

    wants_hidden_states = False  # `logits` gets each row's last hidden state (a drafter reading them)

    def added(self, seq: Sequence) -> None:
        """A request is being queued; raising refuses it, and nothing is queued."""

    def draft_limit(self, request_id: str, draft: tuple[int, ...]) -> int:
        """How many of a draft's first tokens the request's next step may verify."""
        return len(draft)

    def needs_ids(self, request_id: str) -> bool:
        """Whether the request's next step depends on this step's ids (the next is then scheduled after)."""
        return False

    def prepare(self, chunks: list[Chunk]) -> None:
        """A step's chunks are about to run: start what may overlap the forward."""

    def logits(self, rows: LogitRows) -> None:
        """Change the step's logits in place, before drafts are verified and tokens sampled."""

    def forced(self, request_id: str, token_ids: list[int]) -> tuple[list[int], bool]:
        """What the request appends for the ids its step yielded (a grammar's forced run after them), and
        whether its reply must end after those."""
        return token_ids, False

    def appended(self, seq: Sequence, token_ids: list[int], reason: FinishReason | None) -> Ending | None:
        """The reply gained `token_ids`, not committed yet (`reason`: why it ends, None while it goes on): an
        Ending where this processor ends it sooner."""
        return None

    def ended(self, request_id: str) -> None:
        """The request finished, failed or was aborted: forget it."""


class Processors:
    """The registered processors; each hook goes to every one, in order. One that may end a reply inside a
    step's tokens (the text, at a stop string) comes before those that follow the reply's tokens."""

    def __init__(self, processors: Iterable[RequestProcessor] = ()) -> None:
        self._processors = list(processors)

    def register(self, processor: RequestProcessor) -> None:
        """Add a processor: it sees the requests queued from now on."""
        self._processors.append(processor)

    def __iter__(self) -> Iterator[RequestProcessor]:
        return iter(self._processors)

    @property
    def wants_hidden_states(self) -> bool:
        """Whether any processor reads the rows' hidden states."""
        return any(p.wants_hidden_states for p in self._processors)

    def added(self, seq: Sequence) -> None:
        """Every processor takes the request, or none keeps it (the refusal is raised)."""
        try:
            for processor in self._processors:
                processor.added(seq)
        except Exception:
            self.ended(seq.request_id)
            raise

    def draft_limit(self, request_id: str, draft: tuple[int, ...]) -> int:
        """How many of a draft's first tokens every processor lets the request verify."""
        num_tokens = len(draft)
        for processor in self._processors:
            if num_tokens:
                num_tokens = min(num_tokens, processor.draft_limit(request_id, draft[:num_tokens]))
        return num_tokens

    def needs_ids(self, request_id: str) -> bool:
        """Whether any processor needs the step's ids before the request's next step is scheduled."""
        return any(p.needs_ids(request_id) for p in self._processors)

    def prepare(self, chunks: list[Chunk]) -> None:
        """See `RequestProcessor.prepare`."""
        for processor in self._processors:
            processor.prepare(chunks)

    def logits(self, rows: LogitRows) -> None:
        """See `RequestProcessor.logits`."""
        for processor in self._processors:
            processor.logits(rows)

    def forced(self, request_id: str, token_ids: list[int]) -> tuple[list[int], bool]:
        """What the request appends, and whether its reply ends after it."""
        ends = False
        for processor in self._processors:
            token_ids, done = processor.forced(request_id, token_ids)
            ends = ends or done
        return token_ids, ends

    def appended(
        self, seq: Sequence, token_ids: list[int], reason: FinishReason | None
    ) -> tuple[list[int], FinishReason | None]:
        """The tokens that stay of those appended, and why the reply ends (None: it goes on)."""
        for processor in self._processors:
            ending = processor.appended(seq, token_ids, reason)
            if ending is not None:
                token_ids, reason = token_ids[: ending.num_kept], ending.reason
        return token_ids, reason

    def ended(self, request_id: str) -> None:
        """See `RequestProcessor.ended`."""
        for processor in self._processors:
            processor.ended(request_id)
