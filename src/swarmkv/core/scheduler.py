"""Continuous batching: each step's token chunks within a token budget; pages come from the KV manager.

The scheduler owns the queues and the budgets and nothing else: every page decision is a question to the
`KVCacheManager` (`lookup`, `can_allocate`/`allocate`, `commit`, `free`). Its output, a `StepPlan`, tells the
runner what to compute and which pages each request's table gained, so the runner never reads a `Sequence`.

A step's budget goes to decodes first, then to prefills shortest remaining first, running or waiting alike:
an agent returning with a tool result of a few hundred tokens runs before another agent's long cold prompt,
which takes what is left of the budget in chunks, and goes first once it has been passed over for
`starvation_steps` steps in a row. A step may prefill at most `max_num_partial_prefills` requests, so
a burst's shortest get their first tokens first; a follower (a request that waited for another's prefill
of the head they share) is admitted beside the others once that head is computed, and a prefill with at most
a page left is never held back. A preempted request's private pages go to the host tier when copying them there
and back costs less than computing them again. With `max_step_s` (the server's) a step's tokens are capped to
what the measured prefill speed computes in that time, so an abort, applied between steps, waits at most about
that long.

What differs between cache kinds (a hybrid's recurrent states beside the pages) is the KV manager's to answer:
where a prefill chunk should end (`snapshot_point`), whether a waiting request waits for a running prefill
(`prefix_in_flight`), and what to keep after a chunk the plan cut or at a prompt's end (`snapshot`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from swarmkv.core.sequence import Sequence, Status
from swarmkv.core.stats import EngineCounters
from swarmkv.kv import NO_HIT, Hit, KVCacheManager
from swarmkv.spec import Proposer

ChunkKind = Literal["prefill", "decode"]


@dataclass(frozen=True)
class Chunk:
    """Tokens [start, start + len(token_ids)) of one request, computed in this step."""

    seq: Sequence
    start: int
    token_ids: list[int]
    kind: ChunkKind
    samples: bool  # the chunk reaches the request's last token, so a new token is sampled after it
    snapshot: bool = False  # hybrids: keep the recurrent state after this chunk
    # Speculative decoding: tokens drafted after the request's last, the tail of `token_ids`, computed to be
    # verified. Their KV counts as computed only once accepted (`EngineCore.update`).
    draft: tuple[int, ...] = ()

    @property
    def request_id(self) -> str:
        """The request this chunk belongs to."""
        return self.seq.request_id

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this chunk."""
        return len(self.token_ids)

    @property
    def num_logits(self) -> int:
        """Rows of logits the step reads from this chunk: its last, and one more a draft token."""
        return 1 + len(self.draft) if self.samples else 0


def sampling_rows(chunks: list[Chunk]) -> list[int]:
    """Rows of a flat batch of `chunks` (in order) whose logits are read: each sampling chunk's last, or a
    speculative chunk's last `num_logits`."""
    rows: list[int] = []
    end = 0
    for chunk in chunks:
        end += chunk.num_tokens
        rows.extend(range(end - chunk.num_logits, end))
    return rows


@dataclass
class StepPlan:
    """One step: the chunks to compute, the pages each request's table gained since the last plan (a new
    or readmitted request's whole table), and the requests whose tables were freed since the last plan."""

    chunks: list[Chunk] = field(default_factory=list)
    new_pages: dict[str, list[int]] = field(default_factory=dict)
    freed: list[str] = field(default_factory=list)
    state_slots: dict[str, int] = field(default_factory=dict)  # hybrids: each chunk's request's state slot
    gave_up: list[Sequence] = field(default_factory=list)  # finished ("length"): the pool cannot hold them


@dataclass(frozen=True)
class SchedulerLimits:
    """Per-step caps: running requests and tokens computed (prefill chunks plus decodes); after how many
    steps passed over a prefill goes first, how many waiting requests a step looks at, and how many requests
    a step prefills (None: as many as the token budget holds; followers and prefills with a page left aside).
    Fewer prefills a step give the shortest its first token sooner, where a step's cost grows with its
    tokens (a CPU)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    starvation_steps: int = 16
    max_waiting_considered: int = 256
    max_num_partial_prefills: int | None = None
    # Speculative decoding: a step's decode rows and draft tokens together at most (0: no drafts); draft
    # tokens past `max_model_len` positions are never proposed.
    max_speculative_rows: int = 0
    max_model_len: int | None = None
    # The longest a step should take: its tokens are capped to what `PreemptionCost.prefill_s_per_token`, the
    # speed measured from recent prefill steps, computes in it (at least a page's). An abort waits for the step
    # running to end; a 2,048-token CPU prefill takes seconds. None: no cap (model-free tools, tests).
    max_step_s: float | None = None


@dataclass
class PreemptionCost:
    """Swap or recompute: bytes to copy to the host and back against tokens to compute again."""

    page_bytes: int
    copy_bytes_per_s: float  # host <-> device copy bandwidth
    prefill_s_per_token: float  # updated by the engine from the steps it times

    @classmethod
    def guess(
        cls,
        page_bytes: int,
        device_type: str,
        copy_bytes_per_s: float | None = None,
        prefill_s_per_token: float | None = None,
    ) -> PreemptionCost:
        """The given figures, else starting guesses for a `device_type` device, refined from timed steps:
        PCIe-class copies on a GPU, memcpy on the CPU."""
        gpu = device_type == "cuda"
        return cls(
            page_bytes,
            copy_bytes_per_s or (12e9 if gpu else 4e9),
            prefill_s_per_token or (1e-4 if gpu else 3e-3),
        )

    def prefers_swap(self, num_pages: int, num_tokens: int) -> bool:
        """Whether copying `num_pages` out and back is cheaper than prefilling `num_tokens` again."""
        return 2 * num_pages * self.page_bytes / self.copy_bytes_per_s < num_tokens * self.prefill_s_per_token


class Scheduler:
    """Owns the waiting queue and the running list; the one admission path of the engine and its tools."""

    def __init__(
        self,
        kv: KVCacheManager,
        limits: SchedulerLimits,
        counters: EngineCounters,
        cost: PreemptionCost | None = None,
        drafter: Proposer | None = None,
    ) -> None:
        """`drafter`: where decodes' drafts come from (None: no speculative decoding)."""
        self.kv = kv
        self.drafter = drafter
        self.limits = limits
        self.counters = counters
        self.cost = cost or PreemptionCost(page_bytes=1, copy_bytes_per_s=1e9, prefill_s_per_token=1e-3)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._gave_up: list[Sequence] = []  # requests the pool cannot hold, finished here; the next plan's
        self._freed: list[str] = []  # tables freed since the last plan

    @property
    def freed_since_plan(self) -> list[str]:
        """Requests whose tables were freed after the last plan was made (the next plan carries them)."""
        return list(self._freed)

    def add(self, seq: Sequence) -> None:
        """Queue a new request."""
        self.waiting.append(seq)

    def has_work(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.waiting or self.running)

    def cap_step_time(self, max_step_s: float | None) -> None:
        """Cap each step's tokens to what the measured prefill speed computes in `max_step_s` seconds (None:
        the token budget alone)."""
        self.limits = dataclasses.replace(self.limits, max_step_s=max_step_s)

    def step_budget(self) -> int:
        """The tokens the next step may compute: `max_num_batched_tokens`, capped by `max_step_s` at the
        prefill speed measured so far, never below a page's tokens (a prefill always moves)."""
        budget = self.limits.max_num_batched_tokens
        if self.limits.max_step_s is None:
            return budget
        timed = int(self.limits.max_step_s / self.cost.prefill_s_per_token)
        return min(budget, max(timed, self.kv.page_size))

    def schedule(self) -> StepPlan:
        """Pick this step's chunks: decodes first (oldest first), then prefills, shortest remaining first,
        of running requests and of admissions from the queue alike."""
        plan = StepPlan()
        budget = self.step_budget()
        scheduled: set[int] = set()  # ids of sequences with a chunk in this plan: never preempted for another
        for seq in list(self.running):
            if budget == 0:
                break
            if (
                seq.status is Status.RUNNING
                and _is_decoding(seq)
                # Only a provisional last token (async scheduling) leaves such a reply running; it
                # finishes once that token is read back.
                and not seq.reached_length(self.limits.max_model_len)
                and self._reserve(seq, 1, plan, scheduled)
            ):
                scheduled.add(id(seq))
                plan.chunks.append(self._chunk(seq, 1, "decode"))
                budget -= 1
        if self.drafter is not None and plan.chunks:
            budget -= self._add_drafts(plan, self.drafter, budget)
        admitting = True
        prefills = self._prefills(scheduled)
        limit, prefilling = self.limits.max_num_partial_prefills, 0
        for _, remaining, position, seq, _ in prefills:
            if budget == 0:
                break
            full = limit is not None and prefilling >= limit  # only prefills the limit spares run now
            if seq.status is Status.RUNNING:
                if id(seq) in scheduled:
                    continue
                num_tokens = min(seq.num_uncomputed_tokens, budget)
                cut = self._cut(
                    seq, seq.num_computed_tokens, num_tokens, seq.branch_tokens, seq.snapshot_tokens
                )
                num_tokens = cut or num_tokens
                counts = self._counts_against_limit(seq.num_uncomputed_tokens, num_tokens, follower=False)
                if not (full and counts) and self._reserve(seq, num_tokens, plan, scheduled):
                    scheduled.add(id(seq))
                    plan.chunks.append(self._chunk(seq, num_tokens, "prefill", snapshot=cut is not None))
                    budget -= num_tokens
                    prefilling += counts
            elif (
                admitting
                and position >= 0  # not one preempted earlier in this loop
                and seq.status is Status.WAITING
                and len(self.running) < self.limits.max_num_seqs
            ):
                follower = seq.waited_for_prefix
                if full and self._counts_against_limit(remaining, min(remaining, budget), follower):
                    continue
                # With the limit reached another is admitted only if, looked up again, its whole prefill
                # still fits in a page.
                spared = None if follower or not full else self.kv.page_size
                admitted = self._admit(seq, budget, plan, spared)
                if admitted is None:
                    admitting = False  # the shortest waiting prompt does not fit: keep the queue's order
                elif admitted:
                    scheduled.add(id(seq))
                    budget -= admitted
                    prefilling += self._counts_against_limit(seq.num_uncomputed_tokens, admitted, follower)
        for *_, seq, hit in prefills:
            seq.num_starved_steps = 0 if id(seq) in scheduled else seq.num_starved_steps + 1
            if (
                limit is not None
                and hit is not None
                and seq.status is Status.WAITING
                and not seq.waited_for_prefix
            ):
                # Passed over for the budget or the limit, a follower is marked one all the same, so the
                # limit spares it once its head is computed (the sort's hit: pages cached before this step).
                self._waits_for_prefix(seq, hit)
        plan.freed, self._freed = self._freed, []
        plan.gave_up, self._gave_up = self._gave_up, []
        plan.state_slots = self.kv.state_slots([c.request_id for c in plan.chunks])
        return plan

    def _add_drafts(self, plan: StepPlan, drafter: Proposer, budget: int) -> int:
        """Turn decodes into speculative chunks, oldest first, while the step has rows to spare (a step of
        many decodes is compute-bound: drafts would only slow it) and drafts fit in free pages (a draft never
        evicts or preempts). The budget they take."""
        room = min(budget, self.limits.max_speculative_rows - len(plan.chunks))
        taken = 0
        for i, chunk in enumerate(plan.chunks):
            if room - taken <= 0:
                break
            seq = chunk.seq
            # The reply gains at most the accepted draft and one more token.
            left = seq.params.max_tokens - len(seq.output_token_ids) - 1
            if self.limits.max_model_len is not None:
                left = min(left, self.limits.max_model_len - seq.num_tokens)
            draft = drafter.propose(seq.request_id, min(left, room - taken))
            if draft is None or not draft.tokens:
                continue
            tokens = list(draft.tokens)
            in_pages = len(self.kv.page_table(seq.request_id)) * self.kv.page_size - seq.num_tokens
            if self.kv.num_new_pages(seq, NO_HIT, 1 + len(tokens)) > self.kv.num_free:
                tokens = tokens[: max(0, in_pages)]
            if not tokens:
                continue
            pages = self.kv.allocate(seq, NO_HIT, 1 + len(tokens))
            assert pages is not None, "free pages were counted"
            if pages:
                plan.new_pages.setdefault(seq.request_id, []).extend(pages)
            plan.chunks[i] = Chunk(
                seq, chunk.start, [*chunk.token_ids, *tokens], "decode", True, draft=tuple(tokens)
            )
            taken += len(tokens)
        return taken

    def _counts_against_limit(self, num_uncomputed: int, num_tokens: int, follower: bool) -> bool:
        """Whether a prefill chunk of `num_tokens` of a request with `num_uncomputed` tokens left (before
        the chunk) takes one of the step's `max_num_partial_prefills`. A follower's first chunk does not: it
        waited for another request to compute the head they share instead of computing it itself, and
        holding it back again would make sharing cost it steps. Nor does a chunk that ends a prefill of at
        most a page (a short tail after a prefix hit, a prompt's last token): it costs the step about what a
        decode does, and holding it back costs it a whole step."""
        ends_short = num_tokens == num_uncomputed <= self.kv.page_size
        return not (follower or ends_short)

    def _prefills(self, scheduled: set[int]) -> list[tuple[bool, int, int, Sequence, Hit | None]]:
        """Running prefills and waiting requests: first those starved for `starvation_steps` steps, then by
        tokens left to compute (after a waiting request's cached prefix), then running before waiting and in
        queue order (a preempted request is at its front). A waiting request comes with its hit."""
        fed = self._fed
        items: list[tuple[bool, int, int, Sequence, Hit | None]] = [
            (fed(seq), seq.num_uncomputed_tokens, -1, seq, None)
            for seq in self.running
            if id(seq) not in scheduled and not _is_decoding(seq)
        ]
        if len(self.running) < self.limits.max_num_seqs:
            for position, seq in enumerate(
                itertools.islice(self.waiting, self.limits.max_waiting_considered)
            ):
                hit = self._lookup(seq)
                items.append((fed(seq), seq.num_tokens - hit.num_tokens, position, seq, hit))
        items.sort(key=lambda item: item[:3])
        return items

    def _fed(self, seq: Sequence) -> bool:
        """False for a request starved long enough to go first (False sorts before True)."""
        return seq.num_starved_steps < self.limits.starvation_steps

    def _chunk(self, seq: Sequence, num_tokens: int, kind: ChunkKind, snapshot: bool = False) -> Chunk:
        start = seq.num_computed_tokens
        end = start + num_tokens
        return Chunk(seq, start, seq.token_ids[start:end], kind, end == seq.num_tokens, snapshot)

    def _cut(
        self, seq: Sequence, start: int, num_tokens: int, branch_tokens: int, turn_tokens: int
    ) -> int | None:
        """The tokens of a prefill chunk from `start` of at most `num_tokens` when the KV manager has it end
        sooner, to keep what later hits resume from (a hybrid's state snapshot); None: it is not cut."""
        others = itertools.chain(
            itertools.islice(self.waiting, self.limits.max_waiting_considered), self.running
        )
        span = (start, start + num_tokens)
        point = self.kv.snapshot_point(seq, span, branch_tokens, turn_tokens, others)
        return None if point is None else point - start

    def _reserve(self, seq: Sequence, num_tokens: int, plan: StepPlan, scheduled: set[int]) -> bool:
        """Pages for `num_tokens` more tokens of a running request, preempting the newest unscheduled ones."""
        while not self.kv.can_allocate(seq, NO_HIT, num_tokens):
            victims = [s for s in self.running if s is not seq and id(s) not in scheduled]
            if not victims:
                if self.running == [seq]:
                    self._give_up(seq)  # alone and still out of pages: it has outgrown the whole pool
                else:
                    self.preempt(seq)
                return False
            self.preempt(max(victims, key=lambda s: s.arrival))
        pages = self.kv.allocate(seq, NO_HIT, num_tokens)
        assert pages is not None
        if pages:
            plan.new_pages.setdefault(seq.request_id, []).extend(pages)
        return True

    def _admit(
        self, seq: Sequence, budget: int, plan: StepPlan, whole_within: int | None = None
    ) -> int | None:
        """Start a waiting request with its first chunk: the tokens it takes; 0 if it waits for a prefix
        another request is computing, or (with `whole_within`) if more than that many tokens are left to
        compute; None if its pages do not fit."""
        # Looked up again: admissions earlier in this step may have evicted or computed pages.
        hit = self._lookup(seq)
        if self._waits_for_prefix(seq, hit):
            return 0
        if whole_within is not None and seq.num_tokens - hit.num_tokens > min(whole_within, budget):
            return 0
        num_tokens = min(seq.num_tokens - hit.num_tokens, budget)
        cut = self._cut(seq, hit.num_tokens, num_tokens, hit.branch_tokens, hit.turn_tokens)
        num_tokens = cut or num_tokens
        pages = self.kv.allocate(seq, hit, num_tokens)
        if pages is None:
            if not self.running and not plan.chunks:
                self._give_up(seq)  # larger than the whole pool even when it is empty
            return None
        self.waiting.remove(seq)
        seq.waited_for_prefix = False
        plan.new_pages[seq.request_id] = pages
        self._count_hit(seq, hit)
        seq.num_computed_tokens = hit.num_tokens
        seq.branch_tokens = hit.branch_tokens
        seq.snapshot_tokens = hit.turn_tokens
        seq.status = Status.RUNNING
        self.running.append(seq)
        plan.chunks.append(self._chunk(seq, num_tokens, "prefill", snapshot=cut is not None))
        return num_tokens

    def _count_hit(self, seq: Sequence, hit: Hit) -> None:
        """Prompt positions this request never processed before and now finds cached are prefix hits (all
        of its hit at the first admission); hits on its own earlier work after a preemption only spare
        recomputation."""
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = hit.num_tokens
        new = max(0, min(hit.num_tokens, len(seq.prompt_token_ids)) - seq.num_processed_tokens)
        seq.count_hit(self.counters, new)
        seq.num_processed_tokens = max(seq.num_processed_tokens, hit.num_tokens)

    def _lookup(self, seq: Sequence) -> Hit:
        return self.kv.lookup(_uncached_head(seq), seq.cache_salt, seq.page_keys(self.kv.page_size))

    def _waits_for_prefix(self, seq: Sequence, hit: Hit) -> bool:
        """Whether a waiting request waits for a running prefill of what it could hit; if so it is marked a
        follower, which the prefill limit spares when it is admitted."""
        waits = hit.partial is None and self.kv.prefix_in_flight(seq, hit, self.running)
        seq.waited_for_prefix = seq.waited_for_prefix or waits
        return waits

    def commit(self, chunks: list[Chunk]) -> None:
        """Record computed chunks: counters, progress, full pages offered to the prefix index, and what the
        KV manager keeps where the plan cut a prefill or a prompt ends (a hybrid's state snapshot)."""
        for chunk in chunks:
            seq = chunk.seq
            end = chunk.start + chunk.num_tokens - len(chunk.draft)  # drafts count once accepted
            self._count_work(seq, chunk.start, end)
            seq.num_computed_tokens = end
            self.kv.commit(seq, end)
            if chunk.snapshot:
                self.kv.snapshot(seq)
            elif (
                chunk.samples
                and chunk.kind == "prefill"
                and chunk.start < len(seq.prompt_token_ids)  # not a run of appended tokens (jump-forward)
            ):
                # The prompt's end: the next turn always continues it, even when the reply it goes on with
                # re-tokenizes differently from the tokens generated (the turn's end would not match then).
                self.kv.snapshot(seq, "prompt")

    def accept(self, seq: Sequence, num_tokens: int) -> None:
        """A speculative chunk's first `num_tokens` draft tokens were accepted and appended: their KV, computed
        in that chunk, is the request's (its full pages go to the prefix index). `EngineCore.update` calls it."""
        if not num_tokens:
            return
        end = seq.num_computed_tokens + num_tokens
        assert end <= seq.num_tokens, "accepted draft tokens are appended first"
        self._count_work(seq, seq.num_computed_tokens, end)
        seq.num_computed_tokens = end
        self.kv.commit(seq, end)

    def _count_work(self, seq: Sequence, start: int, end: int) -> None:
        """Positions this request processed before are recomputed; new prompt positions are first-time
        prefill; a new generated position is decode. So prefill == prompt - hits + recomputed, always."""
        done = seq.num_processed_tokens
        recomputed = max(0, min(end, done) - start)
        first_prompt = max(0, min(end, len(seq.prompt_token_ids)) - max(start, done))
        seq.count_work(self.counters, recomputed, first_prompt)
        seq.num_processed_tokens = max(done, end)

    def preempt(self, seq: Sequence) -> None:
        """Free the request's pages and requeue it. Its computed KV stays cached; its private pages go to
        the host tier at once when there is room and copying beats recomputing (swap), else they stay on
        the device, evictable, to be hit or recomputed on readmission."""
        self.running.remove(seq)
        private = self.kv.private_pages(seq.request_id)
        num_tokens = seq.num_computed_tokens
        self._free(seq)
        swapped = 0
        if (
            private
            and self.kv.can_swap_out(len(private))
            and self.cost.prefers_swap(len(private), min(num_tokens, len(private) * self.kv.page_size))
        ):
            swapped = self.kv.swap_out(private)
        self.counters.swap_preemptions += swapped > 0
        self.counters.recompute_preemptions += swapped == 0
        seq.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.counters.preemptions += 1

    def finish(self, seq: Sequence, reason: Literal["stop", "length", "abort", "error"]) -> None:
        """Stop a request for good and release its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq, keep_state=reason != "error")
        self.kv.close(seq.request_id)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _free(self, seq: Sequence, keep_state: bool = True) -> None:
        """`keep_state`: False after a failed step, which may have left a hybrid's state half-updated."""
        if self.kv.holds_pages(seq.request_id):
            self.kv.free(seq, keep_partial=True, keep_state=keep_state)
            self._freed.append(seq.request_id)
        seq.num_computed_tokens = 0

    def _give_up(self, seq: Sequence) -> None:
        self.finish(seq, "length")
        self._gave_up.append(seq)

    def check_integrity(self) -> None:
        """Raise AssertionError unless exactly the running requests hold page tables, and the KV books hold."""
        for seq in self.running:
            assert self.kv.holds_pages(seq.request_id), f"running {seq.request_id} holds no pages"
            assert len(self.kv.page_table(seq.request_id)) * self.kv.page_size >= seq.num_computed_tokens
        for seq in self.waiting:
            assert not self.kv.holds_pages(seq.request_id), f"waiting {seq.request_id} holds pages"
        self.kv.check_integrity()


def _uncached_head(seq: Sequence) -> list[int]:
    """The tokens a prefix hit may cover: all but the last, which the step computes to sample from."""
    return seq.token_ids[: seq.num_tokens - 1]


def _is_decoding(seq: Sequence) -> bool:
    """One uncomputed token past the prompt: a generated token to decode. A lone prompt token left over
    from a chunked prefill is still prefill."""
    return seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens >= len(seq.prompt_token_ids)
