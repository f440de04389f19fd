"""Continuous batching: decide each step's token chunks, admit by free pages, preempt by recompute."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Literal

from swarmkv.engine.sequence import Sequence, Status
from swarmkv.engine.stats import EngineCounters
from swarmkv.kv.page_pool import pages_for
from swarmkv.kv.prefix_cache import PrefixCache


@dataclass(frozen=True)
class Chunk:
    """`num_tokens` tokens of `seq`, starting at position `start`, computed in this step."""

    seq: Sequence
    start: int
    num_tokens: int
    kind: Literal["prefill", "decode"]

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's last token, so a new token is sampled after it."""
        return self.start + self.num_tokens == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerLimits:
    """Per-step caps: running sequences and tokens computed (prefill chunks plus decodes)."""

    max_num_seqs: int
    max_num_batched_tokens: int


class Scheduler:
    """Owns the waiting queue and running list; every page change goes through the prefix cache."""

    def __init__(
        self, cache: PrefixCache, block_size: int, limits: SchedulerLimits, counters: EngineCounters
    ) -> None:
        self.cache = cache
        self.block_size = block_size
        self.limits = limits
        self.counters = counters
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.gave_up: list[
            Sequence
        ] = []  # sequences the pool cannot hold, finished here, drained by the engine

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence."""
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.waiting or self.running)

    def schedule(self) -> list[Chunk]:
        """Pick this step's chunks: running sequences first (oldest first), then admissions from the queue."""
        budget = self.limits.max_num_batched_tokens
        chunks: list[Chunk] = []
        scheduled: set[int] = set()
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, num_tokens, scheduled):
                continue
            # A lone prompt token left over from a chunked prefill is still prefill; decode means generated tokens.
            decoding = seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens >= len(seq.prompt_token_ids)
            kind: Literal["prefill", "decode"] = "decode" if decoding else "prefill"
            chunks.append(Chunk(seq, seq.num_computed_tokens, num_tokens, kind))
            scheduled.add(id(seq))
            budget -= num_tokens
        chunks += self._admit(budget)
        return chunks

    def _reserve(self, seq: Sequence, num_tokens: int, scheduled: set[int]) -> bool:
        """Give `seq` pages for `num_tokens` more tokens, preempting the newest unscheduled sequences if needed."""
        needed = seq.pages_needed(seq.num_computed_tokens + num_tokens, self.block_size)
        while not self.cache.can_allocate(needed):
            victims = [s for s in self.running if s is not seq and id(s) not in scheduled]
            if not victims:
                if self.running == [seq]:
                    self._give_up(seq)  # alone and still out of pages: it has outgrown the whole pool
                else:
                    self.preempt(seq)
                return False
            self.preempt(max(victims, key=lambda s: s.arrival))
        seq.page_table += self.cache.allocate(needed)
        return True

    def _admit(self, budget: int) -> list[Chunk]:
        chunks: list[Chunk] = []
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.limits.max_num_seqs:
                break
            tokens = seq.token_ids
            # Keep one token uncached so that the step has something to compute and sample from.
            hit = self.cache.match(tokens[: len(tokens) - 1], seq.cache_salt)
            num_hit = hit.num_tokens(self.block_size)
            if self.cache.shares_pages and hit.partial is None and self._prefix_in_flight(seq, num_hit):
                self.cache.release(hit.pages)
                continue
            num_tokens = min(len(tokens) - num_hit, budget)
            claimed = 1 if hit.partial else 0
            needed = pages_for(num_hit + num_tokens, self.block_size) - len(hit.pages) - claimed
            # Until it is claimed, the partial page counts as evictable: do not count on it twice.
            if not self.cache.can_allocate(needed + claimed):
                self.cache.release(hit.pages)
                if not self.running and not chunks:
                    self._give_up(seq)  # larger than the whole pool even when it is empty
                    continue
                break
            self.waiting.remove(seq)
            partial = [self.cache.claim(hit.partial)] if hit.partial else []
            seq.page_table = hit.pages + partial + self.cache.allocate(needed)
            seq.num_computed_tokens = num_hit
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_hit
            self.counters.prefix_hit_tokens += num_hit
            seq.status = Status.RUNNING
            self.running.append(seq)
            chunks.append(Chunk(seq, num_hit, num_tokens, "prefill"))
            budget -= num_tokens
        return chunks

    def _prefix_in_flight(self, seq: Sequence, num_hit: int) -> bool:
        """Whether a running prefill is about to compute pages `seq` could hit: then wait for them."""
        bs = self.block_size
        tokens = seq.token_ids
        for other in self.running:
            if other.cache_salt != seq.cache_salt or other.num_uncomputed_tokens <= 1:
                continue
            theirs = other.prompt_token_ids
            shared = num_hit
            limit = min(len(tokens) - 1, len(theirs)) // bs * bs
            while shared < limit and tokens[shared : shared + bs] == theirs[shared : shared + bs]:
                shared += bs
            if shared > num_hit and other.num_computed_tokens < shared:
                return True
        return False

    def commit(self, chunks: list[Chunk]) -> None:
        """Record computed chunks and offer their full pages to the prefix cache."""
        for chunk in chunks:
            seq = chunk.seq
            seq.num_computed_tokens = chunk.start + chunk.num_tokens
            self.counters.prefill_tokens_computed += chunk.num_tokens if chunk.kind == "prefill" else 0
            if (
                seq.num_computed_tokens // self.block_size > chunk.start // self.block_size
            ):  # a page filled up
                computed = seq.token_ids[: seq.num_computed_tokens]
                seq.page_table = self.cache.insert(computed, seq.page_table, seq.cache_salt)

    def preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the sequence's pages (cached ones stay for its return) and requeue it."""
        self.running.remove(seq)
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.counters.preemptions += 1

    def finish(self, seq: Sequence, reason: Literal["stop", "length", "abort"]) -> None:
        """Stop a sequence for good and release its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        """Let go of a sequence's pages, leaving all of its computed KV (the partial last page too) cached."""
        computed = seq.token_ids[: seq.num_computed_tokens]
        table = self.cache.insert(computed, seq.page_table, seq.cache_salt, partial=True)
        self.cache.release(table)
        seq.page_table = []

    def _give_up(self, seq: Sequence) -> None:
        self.finish(seq, "length")
        self.gave_up.append(seq)
