"""EngineCore: the engine's bookkeeping without a model, for `LLMEngine` and every tool that needs it.

It owns the scheduler, the KV manager (pages, prefix index, host tier and state slots under it, and the
sessions in its retention), the pins, the counters and the per-request processors, and computes no tensor.
`LLMEngine` drives it around the model: `schedule` -> run the model on the plan's chunks -> `commit` them ->
`update` each request with the ids its step yielded, the one place tokens are committed (stop ids, lengths,
the processors' endings, accepted drafts' KV, finishes) -> `forget` the requests that ended. The planner's
measurement, lint's replay, the cluster's shadow indexes and its simulator drive the same object with
`prefill`, so their books are the engine's books, eviction order and sessions included.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from swarmkv.core.config import EngineConfig
from swarmkv.core.pins import PIN_PARAMS, PinInfo, PinPrefill, Pins
from swarmkv.core.processors import Processors
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.scheduler import Chunk, PreemptionCost, Scheduler, SchedulerLimits, StepPlan
from swarmkv.core.sequence import FinishReason, Sequence, Status
from swarmkv.core.stats import EngineCounters, EngineStats, StateStats
from swarmkv.errors import InvalidRequestError
from swarmkv.kv import KVCacheManager, PageMover, Retention
from swarmkv.kv.state_index import StateMover
from swarmkv.prefix import common_prefix_length
from swarmkv.spec import Proposer

# A measuring or replaying run's own page size in bytes when it has none: figures then count pages.
_ONE_BYTE_PAGES = 1


@dataclass(frozen=True)
class TokenUpdate:
    """What one `update` committed for a request: the tokens its reply gained, and why it ended (None: it
    goes on)."""

    seq: Sequence
    token_ids: list[int]
    reason: FinishReason | None


class EngineCore:
    """Scheduler, KV manager, sessions, pins and counters over `num_pages` pages; no model, no tensors."""

    def __init__(
        self,
        config: EngineConfig,
        num_pages: int,
        *,
        page_bytes: int = _ONE_BYTE_PAGES,
        kv_bytes_per_token: int = 0,
        num_host_pages: int = 0,
        num_state_slots: int = 0,
        state_bytes_per_sequence: int = 0,
        copy_page: Callable[[int, int], None] | None = None,
        page_mover: PageMover | None = None,
        state_mover: StateMover | None = None,
        cost: PreemptionCost | None = None,
        device_type: str = "cpu",
        drafter: Proposer | None = None,
        max_model_len: int | None = None,
        processors: Processors | None = None,
        eos_token_ids: Collection[int] = (),
        counters: EngineCounters | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`copy_page`, `page_mover` and `state_mover` copy the KV tensors the books describe (None: books
        only); `cost` weighs swap against recompute on preemption; `device_type` is the model's device
        ("cpu", "cuda"), for the settings whose auto value differs by device; `drafter`: the decodes' drafts
        (None: no speculative decoding), never past `max_model_len` positions; `processors`: the per-request
        features every request passes through; `eos_token_ids`: the ids that end a reply; `clock` (seconds) times
        the sessions' tool pauses for the `return` retention (a replay passes its own, so it repeats)."""
        self.config = config
        self.page_bytes = page_bytes
        self.kv_bytes_per_token = kv_bytes_per_token
        self.state_bytes_per_sequence = state_bytes_per_sequence
        self.kv = KVCacheManager(
            num_pages,
            config.block_size,
            prefix_caching=config.prefix_caching,
            copy_page=copy_page,
            retention=Retention(config.retention, config.max_open_sessions, clock),
            num_host_pages=num_host_pages,
            mover=page_mover,
            num_state_slots=num_state_slots,
            state_mover=state_mover,
        )
        self.counters = counters or EngineCounters()
        self.processors = processors or Processors()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        limits = SchedulerLimits(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.starvation_steps,
            config.max_waiting_considered,
            config.partial_prefill_limit(device_type),
            config.speculative_rows(device_type) if drafter is not None else 0,
            max_model_len,
        )
        self.drafter = drafter
        self.scheduler = Scheduler(self.kv, limits, self.counters, cost, drafter)
        self.pins = Pins(self.kv, page_bytes, config.max_pinned_bytes, state_bytes=state_bytes_per_sequence)
        self._requests: dict[str, Sequence] = {}
        self._arrivals = 0

    # Requests.

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> Sequence:
        """Queue a request, as the newest turn of `session_id` if given; InvalidRequestError (and nothing
        queued) if its id is taken or its session id is not one, or a processor's refusal (a grammar's)."""
        seq = Sequence(request_id, list(prompt_token_ids), params, cache_salt, session_id=session_id)
        return self._queue(seq)

    def _queue(self, seq: Sequence) -> Sequence:
        request_id, session_id = seq.request_id, seq.session_id
        if request_id in self._requests or request_id in self.pins:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if session_id is not None and not self.valid_session_id(session_id):
            raise InvalidRequestError(
                f"a session id is a non-empty string of at most {self.config.max_session_id_chars} characters"
            )
        self.processors.added(seq)
        self._arrivals += 1
        seq.arrival = self._arrivals
        if session_id is not None:
            self.open_turn(seq)
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def add_pin(
        self,
        pin_id: str,
        token_ids: list[int],
        ttl_s: float | None,
        cache_salt: str | None,
        validate: Callable[[list[int]], None],
    ) -> bool:
        """Pin a prefix: queue its prefill, a `PinPrefill` whose end holds the pages; True when nothing was
        queued because its pages (and a hybrid's state at their end) are cached already and are held at once.
        `validate` refuses a prompt the engine cannot take. InvalidRequestError (PinLimitError past the cap),
        and nothing queued or held, if it cannot be pinned."""
        self.pins.check(pin_id, token_ids, ttl_s)
        prompt = self.pins.prefill_prompt(token_ids, cache_salt)
        if prompt is None:
            if pin_id in self._requests:
                raise InvalidRequestError(f"request id {pin_id!r} is already in use")
            validate(token_ids)
            self.pins.add(pin_id, token_ids, ttl_s, cache_salt)
            self.pins.hold(pin_id, len(token_ids))
            return True
        validate(prompt)
        self._queue(PinPrefill(pin_id, prompt, PIN_PARAMS, cache_salt, pins=self.pins))
        self.pins.add(pin_id, token_ids, ttl_s, cache_salt)
        return False

    def pin_info(self, pin_id: str) -> PinInfo | None:
        """A pin's tokens, bytes and time left, or None."""
        self.pins.expire()
        return self.pins.info(pin_id)

    def unpin(self, pin_id: str) -> bool:
        """Let a pin's pages go (they stay cached until evicted); False if there is no such pin."""
        if pin_id not in self.pins:
            return False
        if not self.abort(pin_id):  # aborting a pin still computing its prefix removes it too
            self.pins.remove(pin_id)
        return True

    @property
    def num_unpinned_tokens(self) -> int:
        """Tokens the KV pool holds besides pinned pages: no prompt as long is ever computed."""
        return (self.kv.num_pages - self.kv.num_pinned) * self.kv.page_size

    def valid_session_id(self, session_id: object) -> bool:
        """Whether `session_id` is one a request may name: a non-empty string, not too long."""
        return isinstance(session_id, str) and 0 < len(session_id) <= self.config.max_session_id_chars

    def open_turn(self, seq: Sequence) -> None:
        """Make `seq` its session's newest turn (the KV manager's retention keeps the sessions). The positions
        the previous turn processed and this one repeats count as the session's own: computing them again
        is recomputation, not new prompt."""
        assert seq.session_id is not None
        previous = self.kv.newest_turn(seq.session_id)
        if isinstance(previous, Sequence):
            common = common_prefix_length(previous.token_ids, seq.prompt_token_ids)
            seq.num_processed_tokens = min(
                common, previous.num_processed_tokens, len(seq.prompt_token_ids) - 1
            )
        self.kv.open_turn(seq)

    def get_sequence(self, request_id: str) -> Sequence | None:
        """The live sequence of a request, if any."""
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_work()

    @property
    def num_arrivals(self) -> int:
        """Requests added so far."""
        return self._arrivals

    def schedule(self) -> StepPlan:
        """This step's chunks (pins past their TTL let go first)."""
        self.pins.expire()
        return self.scheduler.schedule()

    def commit(self, chunks: list[Chunk]) -> None:
        """The chunks' KV is computed: progress, counters and the prefix index follow."""
        self.scheduler.commit(chunks)

    def update(
        self,
        seq: Sequence,
        token_ids: list[int],
        draft: tuple[int, ...] = (),
        ran_ahead: Chunk | None = None,
    ) -> TokenUpdate:
        """The one place a request's tokens are committed. `token_ids`: what its step yielded (after a `draft`
        verified, its accepted tokens, then one more). The processors add what they force (a grammar's run);
        a stop id, `max_tokens` or the context ends the reply at the first token that reaches it; a processor
        may end it sooner (a stop string: the tokens past it are taken back). The accepted draft tokens' KV,
        computed in their chunk, counts at once (a hybrid's state is rewound to them). A request that stopped
        finishes, `ran_ahead` committed first: the chunk a step launched since computes for it (async
        scheduling), so its KV, past the last token, counts when it is freed. A request that gave up in this
        step's plan keeps the tokens and ends with an update without any."""
        if seq.status is Status.FINISHED:
            assert seq.finish_reason == "length", "only a request that gave up is updated once finished"
            for token in token_ids:
                seq.append_token(token)
            kept, reason = self.processors.appended(seq, token_ids, None if token_ids else "length")
            return TokenUpdate(seq, kept, reason)
        num_accepted = len(token_ids) - 1 if draft else 0
        token_ids, grammar_ended = self.processors.forced(seq.request_id, token_ids)
        appended, reason = self._append(seq, token_ids)
        if reason is None and grammar_ended:
            reason = "stop"
        kept, reason = self.processors.appended(seq, appended, reason)
        if len(kept) < len(appended):
            seq.take_back(len(appended) - len(kept))
        num_accepted = min(num_accepted, len(kept))
        if draft:  # before a finish snapshots it
            self.kv.rewind(seq.request_id, 1 + num_accepted)
        self.scheduler.accept(seq, num_accepted)
        seq.count_generated(self.counters, len(kept))
        if reason is not None:
            if ran_ahead is not None:
                self.commit([ran_ahead])
            self.finish(seq, reason)
        return TokenUpdate(seq, kept, reason)

    def _append(self, seq: Sequence, token_ids: list[int]) -> tuple[list[int], FinishReason | None]:
        """Append tokens up to the first that ends the reply (a stop id, max_tokens, the context)."""
        params = seq.params
        for i, token in enumerate(token_ids):
            seq.append_token(token)
            if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
                return token_ids[: i + 1], "stop"
            if seq.reached_length(self.max_model_len):
                return token_ids[: i + 1], "length"
        return token_ids, None

    def end_step(self) -> None:
        """A step ran (its stopped requests finished): count it and the pages' high-water marks."""
        kv, c = self.kv, self.counters
        c.steps += 1
        c.peak_kv_pages_in_use = max(c.peak_kv_pages_in_use, kv.num_in_use)
        c.peak_kv_pages_used = max(c.peak_kv_pages_used, kv.num_pages - kv.num_free)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Stop a request for good and release its pages (its KV stays cached unless a step failed)."""
        self.scheduler.finish(seq, reason)

    def forget(self, request_id: str) -> None:
        """Drop a finished request from the live set: its processors forget it, and its kind ends it (a pin's
        prefill holds its pages)."""
        seq = self._requests.pop(request_id, None)
        self.processors.ended(request_id)
        if seq is not None:
            seq.ended()

    def abort(self, request_id: str) -> bool:
        """Stop a request and release its pages; False if it is unknown or already finished."""
        seq = self._requests.get(request_id)
        if seq is None:
            return False
        self.finish(seq, "abort")
        self.forget(request_id)
        return True

    def release_session(self, session_id: str) -> bool:
        """End a session: its private pages become the first to be evicted. False if it is not open."""
        return self.kv.release_session(session_id)

    def note_tool_call(self, session_id: str, tool: str | None) -> bool:
        """The session's newest reply called `tool` (None: no tool or unknown): the `return` retention
        forecasts when it comes back from that tool's observed pauses. False if it is not open."""
        return self.kv.note_tool(session_id, tool)

    def add_prompt(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> Sequence:
        """Queue a prompt whose KV `compute_prompts` computes without a model, as a request with
        `max_tokens: 1` would have it computed."""
        return self.add_request(
            request_id, prompt_token_ids, SamplingParams(max_tokens=1), cache_salt, session_id
        )

    def compute_prompts(self, seqs: list[Sequence], finish: bool = True) -> list[Sequence | None]:
        """Step (schedule, commit: chunks, hits, evictions as in the engine) until each queued prompt's KV is
        computed; then, with `finish`, each finishes and leaves its KV cached, else it stays running. None
        for one the pool could not hold (it gave up)."""
        while any(s.status is not Status.FINISHED and s.num_computed_tokens < s.num_tokens for s in seqs):
            plan = self.schedule()
            assert any(c.num_tokens for c in plan.chunks) or plan.gave_up, (
                "the pool is too small for these prompts: one waits on pages that running ones hold"
            )
            self.commit(plan.chunks)
            self.end_step()
        done: list[Sequence | None] = []
        for seq in seqs:
            if seq.status is Status.FINISHED:  # gave up: larger than the pool
                self.forget(seq.request_id)
                done.append(None)
                continue
            if finish:
                self.finish(seq, "stop")
                self.forget(seq.request_id)
            done.append(seq)
        return done

    def prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> Sequence | None:
        """One prompt through `add_prompt` and `compute_prompts`, finished: its KV stays cached. None if the
        engine would refuse it (no room for a reply in the whole pool) or the pool could not hold it."""
        if len(prompt_token_ids) >= self.kv.num_pages * self.kv.page_size:
            return None
        return self.compute_prompts([self.add_prompt(request_id, prompt_token_ids, cache_salt, session_id)])[
            0
        ]

    # Reading.

    def snapshot(self) -> EngineStats:
        """KV and work counters, in pages, bytes and tokens."""
        self.pins.expire()  # an idle engine does not step, but its expired pins are gone all the same
        kv, c, page = self.kv, self.counters, self.page_bytes
        logical_pages = sum(len(kv.page_table(s.request_id)) for s in self.scheduler.running)
        host = kv.host
        return EngineStats(
            kv_bytes_per_token=self.kv_bytes_per_token,
            block_size=kv.page_size,
            kv_pages_total=kv.num_pages,
            kv_pages_in_use=kv.num_in_use,
            kv_pages_cached=kv.num_cached,
            kv_pages_free=kv.num_free,
            kv_bytes_in_use=kv.num_in_use * page,
            kv_bytes_cached=kv.num_cached * page,
            kv_bytes_logical=logical_pages * page,
            kv_bytes_used=(kv.num_pages - kv.num_free) * page,
            peak_kv_bytes_in_use=c.peak_kv_pages_in_use * page,
            peak_kv_bytes_used=c.peak_kv_pages_used * page,
            prompt_tokens=c.prompt_tokens,
            prefill_tokens_computed=c.prefill_tokens_computed,
            prefix_hit_tokens=c.prefix_hit_tokens,
            recomputed_tokens=c.recomputed_tokens,
            generated_tokens=c.generated_tokens,
            preemptions=c.preemptions,
            swap_preemptions=c.swap_preemptions,
            recompute_preemptions=c.recompute_preemptions,
            evictions=kv.num_evictions,
            offload_capacity_bytes=host.num_pages * page,
            offloaded_bytes=kv.num_offloaded * page,
            offload_stores=host.counters.stores,
            offload_loads=host.counters.loads,
            offload_load_bytes=host.counters.loads * page,
            offload_drops=host.counters.drops,
            pins=len(self.pins),
            pinned_bytes=self.pins.held_bytes,
            sessions_open=kv.num_open_sessions,
            sessions_paused=kv.num_paused_sessions,
            cascade_decode_rows=c.cascade_decode_rows,
            cascade_shared_tokens=c.cascade_shared_tokens,
            requests_running=len(self.scheduler.running),
            requests_waiting=len(self.scheduler.waiting),
            requests_finished=c.requests_finished,
            requests_failed=c.requests_failed,
            failed_steps=c.failed_steps,
            steps=c.steps,
            pin_prompt_tokens=c.pin_prompt_tokens,
            pin_prefill_tokens_computed=c.pin_prefill_tokens_computed,
            pin_prefix_hit_tokens=c.pin_prefix_hit_tokens,
            pin_recomputed_tokens=c.pin_recomputed_tokens,
            spec_verify_steps=c.spec_verify_steps,
            spec_draft_tokens=c.spec_draft_tokens,
            spec_accepted_tokens=c.spec_accepted_tokens,
            spec_accepted_sibling_tokens=c.spec_accepted_sibling_tokens,
            spec_accepted_session_tokens=c.spec_accepted_session_tokens,
            spec_mtp_draft_tokens=c.spec_mtp_draft_tokens,
            spec_accepted_mtp_tokens=c.spec_accepted_mtp_tokens,
            lookahead_steps=c.lookahead_steps,
            state=self._state_stats(),
        )

    def _state_stats(self) -> StateStats | None:
        states = self.kv.states.index
        if states is None:
            return None
        per = self.state_bytes_per_sequence
        return StateStats(
            state_bytes_per_sequence=per,
            state_slots_total=states.num_slots,
            state_bytes_total=states.num_slots * per,
            state_bytes_in_use=states.num_running * per,
            state_snapshots=states.num_snapshots,
            state_snapshot_bytes=states.num_snapshots * per,
            state_snapshot_stores=states.counters.stores,
            state_snapshot_hits=states.counters.hits,
            state_snapshot_drops=states.counters.drops,
        )

    def check_writable(self, chunks: list[Chunk]) -> None:
        """With `check_writes`, assert that every chunk writes only pages its request holds alone."""
        if self.config.check_writes:
            for chunk in chunks:
                self.kv.check_writable(chunk.request_id, chunk.start, chunk.start + chunk.num_tokens)

    def check_integrity(self) -> None:
        """Assert that queues, pages, refcounts, page tables and the prefix index agree."""
        self.scheduler.check_integrity()

    def check_rows(self, rows: Collection[str], pages: Callable[[str], list[int]]) -> None:
        """Assert that a runner's resident page tables agree with the books: `rows` (the requests it holds a
        row for) only of running requests or of those freed since the last plan (the next plan drops them),
        and `pages(request_id)` each running request's page table."""
        live = {s.request_id for s in self.scheduler.running} | set(self.scheduler.freed_since_plan)
        assert set(rows) <= live, f"rows of stopped requests: {sorted(set(rows) - live)}"
        for seq in self.scheduler.running:
            have = pages(seq.request_id)
            assert have == list(self.kv.page_table(seq.request_id)), (
                f"{seq.request_id}: the runner's row is stale"
            )
