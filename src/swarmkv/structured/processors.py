"""Constrained decoding and the loop guard as per-request processors (`core/processors.py`): a request's
grammar masks its rows of logits, cuts its drafts, forces runs and ends its reply; the loop guard lowers its
loop's continuation and keeps its drafts to rows no penalty reaches."""

from __future__ import annotations

from swarmkv.choices import LoopGuardMode
from swarmkv.core.processors import Ending, LogitRows, RequestProcessor
from swarmkv.core.scheduler import Chunk
from swarmkv.core.sequence import FinishReason, Sequence
from swarmkv.kv.retention import GROUP_SEP
from swarmkv.structured.decoding import MaskJob, StructuredDecoding
from swarmkv.structured.loop_guard import LoopGuard
from swarmkv.tokenizer import Tokenizer


def salt_root(cache_salt: str | None) -> str | None:
    """The scope a request's compiled grammar is shared in: its salt's root, the tenant's name under
    `--api-keys` (whose salts are `TENANT` or `TENANT\\0SALT`), a client's own salt without keys."""
    return None if cache_salt is None else cache_salt.partition(GROUP_SEP)[0]


class Grammars(RequestProcessor):
    """The constrained requests' matchers (the grammar library's vocabulary is built by the first one)."""

    def __init__(
        self, tokenizer: Tokenizer, vocab_size: int, jump_forward: bool, close_at_length: bool = True
    ) -> None:
        self._args = (tokenizer, vocab_size, jump_forward, close_at_length)
        self.built: StructuredDecoding | None = None
        self._job: MaskJob | None = None
        self._lengths: dict[str, Sequence] = {}  # constrained requests, for the tokens left to their length

    @property
    def decoding(self) -> StructuredDecoding:
        """The matchers, built on first use."""
        if self.built is None:
            self.built = StructuredDecoding(*self._args)
        return self.built

    def added(self, seq: Sequence) -> None:
        """A grammar's matcher past its prefix; UnsupportedSchemaError if it does not compile."""
        if seq.params.grammar is not None:
            scope = salt_root(seq.cache_salt)
            state = self.decoding.start(seq.params.grammar, seq.params.grammar_prefix, scope)
            self.decoding.add(seq.request_id, state)
            self._lengths[seq.request_id] = seq

    def draft_limit(self, request_id: str, draft: tuple[int, ...]) -> int:
        """The draft tokens the grammar allows before any forced run."""
        return self.built.draftable(request_id, draft) if self.built is not None else len(draft)

    def needs_ids(self, request_id: str) -> bool:
        """A grammar's mask follows the last token."""
        return self.built is not None and request_id in self.built

    def prepare(self, chunks: list[Chunk]) -> None:
        """The masks are computed on a thread while the forward runs."""
        self._job = self.built.prefetch(chunks) if self.built is not None else None

    def logits(self, rows: LogitRows) -> None:
        """Every constrained row, a draft's included, masked before any is verified."""
        job, self._job = self._job, None
        if job is not None:
            self.decoding.apply(job, rows.chunks, rows.logits)

    def forced(self, request_id: str, token_ids: list[int]) -> tuple[list[int], bool]:
        """A forced run after the tokens (or a queued forced token instead), and whether the grammar ended."""
        built = self.built
        if built is None or request_id not in built:
            return token_ids, False
        appended = built.advance(request_id, token_ids)
        seq = self._lengths[request_id]  # every constrained request's, from `added` to `ended`
        appended = built.fit(request_id, seq.params.max_tokens - len(seq.output_token_ids), appended)
        return appended, built.is_complete(request_id)

    def appended(self, seq: Sequence, token_ids: list[int], reason: FinishReason | None) -> Ending | None:
        """A reply whose ending was forced at its length ends for its length, even a token or two short."""
        if reason == "stop" and self.built is not None and self.built.closed(seq.request_id):
            return Ending(len(token_ids), "length")
        return None

    def ended(self, request_id: str) -> None:
        """The matcher goes."""
        self._lengths.pop(request_id, None)
        if self.built is not None:
            self.built.drop(request_id)


class Guard(RequestProcessor):
    """The loop guard over every reply (`all`) or the constrained ones; a constrained reply's looped string
    is steered to close."""

    def __init__(self, mode: LoopGuardMode, grammars: Grammars) -> None:
        self.mode = mode
        self.grammars = grammars
        self.guard = LoopGuard()

    def added(self, seq: Sequence) -> None:
        """Guard the reply if the mode covers it."""
        constrained = seq.params.grammar is not None
        if not seq.replies or not (self.mode == "all" or (self.mode == "constrained" and constrained)):
            return
        if constrained:
            self.guard.add(seq.request_id, self.grammars.decoding.json_strings, seq.params.grammar_prefix)
        else:
            self.guard.add(seq.request_id)

    def draft_limit(self, request_id: str, draft: tuple[int, ...]) -> int:
        """The draft tokens whose rows no penalty can reach."""
        limit = self.guard.draftable(request_id)
        return len(draft) if limit is None else min(len(draft), limit)

    def needs_ids(self, request_id: str) -> bool:
        """The penalty follows the last token."""
        return request_id in self.guard

    def logits(self, rows: LogitRows) -> None:
        """Penalise the rows that sample one token (no guarded row of a draft has a penalty: `draft_limit`)."""
        plain = [
            (row, chunk) for row, chunk in zip(rows.first_rows(), rows.chunks, strict=True) if not chunk.draft
        ]
        if plain:
            self.guard.apply([chunk for _, chunk in plain], rows.logits, [row for row, _ in plain])

    def appended(self, seq: Sequence, token_ids: list[int], reason: FinishReason | None) -> Ending | None:
        """The guard reads the reply's new tokens."""
        self.guard.extend(seq.request_id, token_ids)
        return None

    def ended(self, request_id: str) -> None:
        """The reply goes."""
        self.guard.drop(request_id)
