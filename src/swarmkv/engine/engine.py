"""LLMEngine: the incremental interface (add_request, step, abort) over `EngineCore` and the model.

A step reads top-down, along vLLM v1's lines: `EngineCore.schedule()` -> the executor runs the plan and returns
each request's accepted ids (verifying drafts, sampling) -> `EngineCore.update` appends them, the one place
tokens are committed. The per-request features (text, grammar, loop guard, drafts, seeded sampling) are
processors in one list (`core/processors.py`). Requests may belong to sessions (an agent's turns); pins hold a
prefix's pages for a while. A step whose forward or sampler raises fails only that step's requests: their
pages go back (their earlier KV stays cached), the runner forgets their rows, and the next step runs as usual.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

import swarmkv.resolve as resolve
from swarmkv.core.config import EngineConfig
from swarmkv.core.core import EngineCore, TokenUpdate
from swarmkv.core.drafts import Drafts
from swarmkv.core.pins import PinInfo
from swarmkv.core.processors import Processors
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.scheduler import Chunk, PreemptionCost, StepPlan
from swarmkv.core.sequence import Sequence, Status
from swarmkv.core.stats import EngineCounters, EngineStats
from swarmkv.engine.backend import resolve_attention_backend
from swarmkv.engine.executor import Executor
from swarmkv.engine.kv_budget import KVBudget
from swarmkv.engine.logit_adjustments import LogitAdjustments
from swarmkv.engine.lookahead import InFlight, Lookahead
from swarmkv.engine.output_processor import OutputProcessor, RequestDelta
from swarmkv.engine.sampler import SeededSampling
from swarmkv.engine.settings import engine_settings
from swarmkv.errors import InvalidRequestError
from swarmkv.models.loader import LoadedModel
from swarmkv.structured.decoding import StructuredDecoding
from swarmkv.structured.processors import Grammars, Guard

__all__ = ["EngineConfig", "LLMEngine", "RequestDelta"]


log = logging.getLogger(__name__)


class LLMEngine:
    """Steps every live request forward together; each step computes one batch of chunks."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded, self.tokenizer, self.config = loaded, loaded.tokenizer, config
        budget = KVBudget.of(loaded, config)
        self.kv_dtype, self.kv_bytes_per_token = budget.kv_dtype, budget.kv_bytes_per_token
        self.page_bytes, self.max_model_len = budget.page_bytes, budget.max_model_len
        device = loaded.device
        kv_tensors, host_kv, self.states = budget.tensors(loaded, config.block_size)
        self.preemption_cost = PreemptionCost.guess(
            budget.page_bytes, device.type, config.swap_bytes_per_s, config.prefill_s_per_token
        )
        self.attention_backend = resolve_attention_backend(config.attention_backend, device)
        # The processors, text first: it may end a reply inside a step's tokens, which the others then follow.
        self.outputs = OutputProcessor(self.tokenizer)
        jump = resolve.jump_forward(config.jump_forward, device.type)
        self.grammars = Grammars(self.tokenizer, loaded.config.vocab_size, jump, config.close_at_length)
        self.seeded = SeededSampling(config.seed)
        self.guard = Guard(config.loop_guard, self.grammars) if config.loop_guard != "off" else None
        guard, adjust = [self.guard] if self.guard else [], LogitAdjustments(loaded.config.vocab_size)
        self.processors = Processors([self.outputs, adjust, self.grammars, *guard, self.seeded])
        self.lookahead = Lookahead(config.lookahead(device.type))
        self.counters = EngineCounters()  # the core's, and the step's own counts (failures, lookahead)
        drafts = None
        if resolve.speculation(config.speculation):
            limit, mtp = self.processors.draft_limit, loaded.model.mtp is not None
            drafts = Drafts.of(config, self.counters, limit, self.lookahead.enabled, mtp)
            self.processors.register(drafts)
        self.drafter = drafts.drafter if drafts is not None else None
        self.core = EngineCore(
            config,
            budget.num_pages,
            page_bytes=budget.page_bytes,
            kv_bytes_per_token=budget.kv_bytes_per_token,
            num_host_pages=budget.num_host_pages,
            num_state_slots=budget.num_state_slots,
            state_bytes_per_sequence=budget.state_bytes_per_sequence,
            copy_page=kv_tensors.copy_page,
            page_mover=host_kv,
            state_mover=self.states,
            cost=self.preemption_cost,
            device_type=device.type,
            drafter=self.drafter,
            max_model_len=self.max_model_len,
            processors=self.processors,
            eos_token_ids=self.tokenizer.eos_token_ids,
            counters=self.counters,
        )
        self.runner = Executor.runner_for(
            loaded, config, kv_tensors, self.states, self.counters, self.attention_backend, self.max_model_len
        )
        self.executor = Executor(self.runner, self.processors, self.seeded, drafts, self.lookahead)
        limits = self.core.scheduler.limits
        self.settings = engine_settings(
            loaded, budget, self.runner, limits, jump, drafts is not None, self.lookahead.enabled
        )
        log.info("engine settings: %s", self.settings.describe())
        self.last_step_error: str | None = None  # set while the latest step failed

    @property
    def healthy(self) -> bool:
        """False while the latest step failed: the engine may be unusable until a step succeeds."""
        return self.last_step_error is None

    @property
    def structured(self) -> StructuredDecoding:
        """The constrained requests' matchers (the grammar library's vocabulary is built on first use)."""
        return self.grammars.decoding

    def probe(self) -> bool:
        """After a failed step, when idle, run one token through the model: whether the engine works again.
        (While requests are in flight their next step answers the same question.)"""
        if self.last_step_error is not None and not self.has_unfinished():
            rid = f"health-probe-{self.core.num_arrivals}"
            self.add_request(rid, [0], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            while self.has_unfinished():
                self.step()
        return self.healthy

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        session_id: str | None = None,
    ) -> None:
        """Queue a request, as the newest turn of `session_id` if given; InvalidRequestError (and nothing
        queued) if it cannot ever run."""
        self._validate_prompt(prompt_token_ids)
        self.core.add_request(request_id, prompt_token_ids, params, cache_salt, session_id)

    def release_session(self, session_id: str) -> bool:
        """End a session: its private pages are evicted first (`EngineCore.release_session`)."""
        return self.core.release_session(session_id)

    def add_pin(
        self, pin_id: str, prompt_token_ids: list[int], ttl_s: float | None, cache_salt: str | None = None
    ) -> bool:
        """Pin a prefix until `ttl_s` runs out or `unpin` (`EngineCore.add_pin`): its prefill's delta arrives
        like any request's, unless True says the pin is held at once."""
        return self.core.add_pin(pin_id, prompt_token_ids, ttl_s, cache_salt, self._validate_prompt)

    def get_pin(self, pin_id: str) -> PinInfo | None:
        """A pin's tokens, bytes and time left, or None."""
        return self.core.pin_info(pin_id)

    def unpin(self, pin_id: str) -> bool:
        """Let a pin's pages go (they stay cached until evicted); False if there is no such pin."""
        return self.core.unpin(pin_id)

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.loaded.config.vocab_size
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; the context holds {self.max_model_len} including the reply"
            )
        if len(ids) >= (pool_tokens := self.core.num_unpinned_tokens):
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; the KV pool holds {pool_tokens} besides pinned pages"
            )

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running, or a step's ids are still to be read."""
        return self.core.has_unfinished() or self.lookahead.in_flight is not None

    def step(self) -> list[RequestDelta]:
        """Schedule, execute, update; return what each request produced (finished requests are forgotten
        here). With async scheduling a step's tokens come out of the next call, which launches the step after
        it first."""
        plan = self.core.schedule()
        # Every plan reaches the resident page table, one without chunks too: it may only free rows.
        self.runner.update_page_table(plan)
        in_flight = self.lookahead.take()
        deltas = self._execute(plan, in_flight) if plan.chunks else []
        if not plan.chunks and in_flight is not None:
            deltas = self._settle(in_flight, plan, ran_ahead={})
        deltas += [self._delta(self.core.update(seq, [])) for seq in plan.gave_up]
        for delta in deltas:
            if delta.finished:
                self.core.forget(delta.request_id)
                self.counters.requests_finished += delta.error is None
        return deltas

    def _execute(self, plan: StepPlan, in_flight: InFlight | None) -> list[RequestDelta]:
        """Run the plan (`in_flight`: the step before, launched with its ids on the device, whose provisional
        tokens this plan's decodes compute; its ids are read once this step is launched), then commit."""
        start = time.perf_counter()
        try:
            self.core.check_writable(plan.chunks)
            output = self.executor.execute(plan, in_flight.inputs() if in_flight is not None else None)
        except Exception as exc:
            # This step computed nothing to keep: a request the step before stopped is freed without it.
            deltas = self._settle(in_flight, plan, {}) if in_flight is not None else []
            return deltas + self._fail(plan.chunks, exc)
        self.last_step_error = None
        self.counters.lookahead_steps += in_flight is not None
        deltas = self._settle(in_flight, plan, {c.request_id: c for c in plan.chunks}) if in_flight else []
        self._time_prefill(plan, time.perf_counter() - start)
        # A request the step before finished computed this step for nothing: it has nothing to commit.
        self.core.commit([c for c in plan.chunks if c.seq.status is Status.RUNNING])
        if output.launched is not None:
            self.lookahead.launch(output.launched)
        for row in output.rows:
            if row.chunk.seq.status is Status.RUNNING:
                deltas.append(self._delta(self.core.update(row.chunk.seq, row.token_ids, row.chunk.draft)))
        self.core.end_step()
        return deltas

    def _settle(self, in_flight: InFlight, plan: StepPlan, ran_ahead: dict[str, Chunk]) -> list[RequestDelta]:
        """Update the requests of a launched step with its ids, now read, in place of their provisional tokens.
        `ran_ahead`: the chunks of the step launched after it, by request. If the ids cannot be read, the
        step's requests fail."""
        try:
            settled = self.lookahead.settle(in_flight)
        except Exception as exc:
            return self._fail(in_flight.sampling, exc)
        deltas = []
        for chunk, token in settled:
            seq = chunk.seq
            # Aborted or failed meanwhile, the token was never shown, so the reply ends without it; one that
            # gave up keeps it, and the step ends it.
            if seq.status is not Status.FINISHED or seq in plan.gave_up:
                deltas.append(
                    self._delta(self.core.update(seq, [token], ran_ahead=ran_ahead.get(seq.request_id)))
                )
        return deltas

    def _delta(self, update: TokenUpdate) -> RequestDelta:
        return self.outputs.take(update.seq.request_id)

    def _time_prefill(self, plan: StepPlan, elapsed_s: float) -> None:
        """Refine the per-token prefill cost that swap-or-recompute decisions weigh, from a prefill step."""
        num_tokens = sum(c.num_tokens for c in plan.chunks)
        if num_tokens >= 16 and any(c.kind == "prefill" for c in plan.chunks):
            cost = self.preemption_cost
            cost.prefill_s_per_token = 0.8 * cost.prefill_s_per_token + 0.2 * elapsed_s / num_tokens

    def _fail(self, chunks: list[Chunk], exc: Exception) -> list[RequestDelta]:
        """Fail a step's requests and only those: their KV computed in earlier steps stays cached."""
        log.exception("a step of %d chunk(s) failed; failing its requests", len(chunks))
        self.last_step_error = f"{type(exc).__name__}: {exc}"
        self.counters.failed_steps += 1
        chunks = [c for c in chunks if c.seq.status is not Status.FINISHED]
        self.runner.page_table.drop([c.request_id for c in chunks])  # their rows go with them
        deltas = []
        for chunk in chunks:
            Lookahead.drop(chunk.seq)
            self.core.finish(chunk.seq, "error")
            self.counters.requests_failed += 1
            deltas.append(
                self.outputs.fail(chunk.request_id, "the engine failed while computing this request")
            )
        return deltas

    def abort(self, request_id: str) -> bool:
        """Stop a request and release its pages; False if it is unknown or already finished."""
        return self.core.abort(request_id)

    def get_sequence(self, request_id: str) -> Sequence | None:
        """The live sequence of a request, if any."""
        return self.core.get_sequence(request_id)

    def check_integrity(self) -> None:
        """Assert that pages, refcounts, page tables, the prefix index and the runner's rows agree."""
        self.core.check_integrity()
        self.core.check_rows(self.runner.page_table.request_ids, self.runner.page_table.pages)

    def snapshot(self) -> EngineStats:
        """KV and work counters, in pages, bytes and tokens: the typed form every reader uses."""
        structured, guard = self.grammars.built, self.guard.guard if self.guard is not None else None
        return dataclasses.replace(
            self.core.snapshot(),
            grammars_compiled=structured.grammars.num_compiled if structured is not None else 0,
            grammar_cache_hits=structured.grammars.num_hits if structured is not None else 0,
            forced_tokens=structured.num_forced_tokens if structured is not None else 0,
            loop_guard_penalties=guard.num_penalised if guard is not None else 0,
            loop_guard_closing=guard.num_closing if guard is not None else 0,
        )

    def stats(self) -> dict[str, Any]:
        """`snapshot()` as a flat dict (the public API), with the resolved settings and a GGUF's weights per
        type as held."""
        out = self.snapshot().to_dict()
        out["settings"] = self.settings.to_dict()
        report = self.loaded.weight_report
        if report is not None:
            out["weights"] = report.to_json()
        return out
