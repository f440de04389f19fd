"""LLMEngine: the incremental interface (add_request, step, abort) over scheduler, KV manager and runner.

`step()` schedules, runs the model, samples and commits: it computes tokens. The output processor turns
them into text deltas. Requests may belong to sessions (an agent's turns); sessions steer which cached pages
are evicted first, and `release_session` ends one. Pins hold a prefix's pages for a while. A step whose forward or sampler raises fails only that step's requests: their pages
go back (their earlier KV stays cached), the runner forgets their rows, and the next step runs as usual.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any

import torch

from swarmkv.core.config import EngineConfig
from swarmkv.core.core import EngineCore
from swarmkv.core.pins import PinInfo
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.scheduler import Chunk, PreemptionCost, StepPlan
from swarmkv.core.sequence import FinishReason, Sequence, Status
from swarmkv.core.stats import EngineStats
from swarmkv.engine import cpu_decode
from swarmkv.engine.backend import resolve_attention_backend
from swarmkv.engine.host_kv import HostKV
from swarmkv.engine.kv_cache import KVCache, kv_storage_dtype
from swarmkv.engine.kv_calibration import calibrate_kv_scales
from swarmkv.engine.lookahead import InFlight
from swarmkv.engine.output_processor import OutputProcessor, RequestDelta
from swarmkv.engine.page_table import PageTable
from swarmkv.engine.runner import ModelRunner
from swarmkv.engine.sampler import greedy_ids, sample, sample_on_device
from swarmkv.engine.speculative import verify_greedy, verify_sampled
from swarmkv.engine.state_cache import StateCache
from swarmkv.errors import CapacityError, InvalidRequestError
from swarmkv.kv import pages_for
from swarmkv.models.loader import LoadedModel
from swarmkv.spec import Drafter
from swarmkv.structured.decoding import StructuredDecoding
from swarmkv.structured.loop_guard import LoopGuard

__all__ = ["EngineConfig", "LLMEngine", "RequestDelta"]


log = logging.getLogger(__name__)


class LLMEngine:
    """Steps every live request forward together; each step computes one batch of chunks."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.config = config
        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, loaded.dtype)
        if config.kv_cache_dtype == "auto" and config.fused_cpu_decode:
            self.kv_dtype = (
                cpu_decode.auto_kv_dtype(loaded.model, loaded.dtype, loaded.device) or self.kv_dtype
            )
        self.kv_bytes_per_token = loaded.config.kv_bytes_per_token(self.kv_dtype)
        page_bytes = self.kv_bytes_per_token * config.block_size
        # A hybrid's recurrent states (running and snapshots) come out of the same budget as the pages.
        self.state_bytes_per_sequence = loaded.config.state_bytes_per_sequence(loaded.dtype)
        num_state_slots = 0
        if self.state_bytes_per_sequence:
            num_state_slots = config.state_bytes // self.state_bytes_per_sequence
            if num_state_slots < 2:
                raise CapacityError(
                    f"state_memory of {config.state_bytes} bytes holds {num_state_slots} recurrent state(s) of "
                    f"{self.state_bytes_per_sequence} bytes; a hybrid model needs at least 2 (one running, one "
                    f"snapshot): raise kv_cache_memory or state_memory"
                )
        num_pages = (config.kv_cache_bytes - num_state_slots * self.state_bytes_per_sequence) // page_bytes
        model_len = loaded.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            raise CapacityError(
                f"max_model_len={config.max_model_len} exceeds the model's context of {model_len} positions"
            )
        self.max_model_len = config.max_model_len if config.max_model_len is not None else model_len
        if num_pages < 2:
            # One page for the prompt and one to decode into is the least any request needs.
            raise CapacityError(
                f"a KV pool of {config.kv_cache_bytes} bytes holds {num_pages} page(s) of {page_bytes} bytes; "
                f"it cannot hold a single request: raise kv_cache_memory"
            )
        self.page_bytes = page_bytes
        kv_tensors = KVCache(
            loaded.config, num_pages, config.block_size, loaded.dtype, loaded.device, self.kv_dtype
        )
        if kv_tensors.is_fp8:
            calibrate_kv_scales(loaded.model, kv_tensors, loaded.tokenizer)
        num_host_pages = config.offload_bytes // page_bytes if config.prefix_caching else 0
        self.host_kv = HostKV(kv_tensors, num_host_pages) if num_host_pages else None
        self.states: StateCache | None = None
        if num_state_slots:
            self.states = StateCache(loaded.config, num_state_slots, loaded.dtype, loaded.device)
            assert self.states.bytes_per_slot == self.state_bytes_per_sequence
        gpu = loaded.device.type == "cuda"
        # Starting guesses, refined from timed steps: PCIe-class copies on a GPU, memcpy on the CPU.
        self.preemption_cost = PreemptionCost(
            page_bytes,
            config.swap_bytes_per_s or (12e9 if gpu else 4e9),
            config.prefill_s_per_token or (1e-4 if gpu else 3e-3),
        )
        self.attention_backend = resolve_attention_backend(config.attention_backend, loaded.device)
        drafter = None
        # Async scheduling: the next step is scheduled before this one's ids are read, which a request that
        # drafts from them cannot wait for (`_looks_ahead`); one whose text matched nothing lately skips a
        # few proposals, so such steps may run ahead.
        self.lookahead = config.lookahead(loaded.device.type)
        if self._speculates(config):
            drafter = Drafter(
                config.num_speculative_tokens,
                idle_wait_steps=4 if self.lookahead else 0,
                vet=self._draftable,
                sources=config.draft_sources,
            )
        self.core = EngineCore(
            config,
            num_pages,
            page_bytes=page_bytes,
            kv_bytes_per_token=self.kv_bytes_per_token,
            num_host_pages=num_host_pages,
            num_state_slots=num_state_slots,
            state_bytes_per_sequence=self.state_bytes_per_sequence,
            copy_page=kv_tensors.copy_page,
            page_mover=self.host_kv,
            state_mover=self.states,
            cost=self.preemption_cost,
            device_type=loaded.device.type,
            drafter=drafter,
            max_model_len=self.max_model_len,
        )
        self.drafter = drafter
        # The core's parts, named for the tests and benchmarks that read them.
        self.kv, self.scheduler, self.pins, self.counters = (
            self.core.kv,
            self.core.scheduler,
            self.core.pins,
            self.core.counters,
        )
        max_pages = pages_for(self.max_model_len, config.block_size)  # a request that fills the context
        page_table = PageTable(config.max_num_seqs, max_pages, config.block_size, loaded.device)
        self.runner = ModelRunner(
            loaded.model,
            kv_tensors,
            page_table,
            self.counters,
            config.cascade_attention,
            cascade_min_saved_tokens=config.cascade_min_saved_tokens,
            backend=self.attention_backend,
            cuda_graphs=loaded.device.type == "cuda" and not config.enforce_eager,
            mixed_step_graphs=config.mixed_step_graphs,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            states=self.states,
            fused_cpu_decode=config.fused_cpu_decode,
            cpu_int8_activations=config.cpu_int8_activations,
            cpu_int8_residual_groups=config.cpu_int8_residual_groups,
            cpu_prefill_bf16=config.cpu_prefill_bf16,
        )
        self.outputs = OutputProcessor(self.tokenizer)
        self._generators: dict[str, torch.Generator] = {}
        self._generator = torch.Generator().manual_seed(config.seed)
        self._structured: StructuredDecoding | None = None  # built by the first constrained request
        self.loop_guard = LoopGuard() if config.loop_guard != "off" else None
        self.last_step_error: str | None = None  # set while the latest step failed
        # Async scheduling: the step launched last whose ids are not read yet (see engine/lookahead.py).
        self._in_flight: InFlight | None = None

    @staticmethod
    def _speculates(config: EngineConfig) -> bool:
        """Whether drafts are verified: `speculation` is not off. Verification is exact on every model and
        backend: a hybrid keeps the state after each drafted position (the torch backend's `RecurrentStep`,
        the triton backend's `TritonRecurrentStep`) and is rewound to the last accepted one
        (`StateCache.rewind`)."""
        return config.speculation != "off"

    @property
    def healthy(self) -> bool:
        """False while the latest step failed: the engine may be unusable until a step succeeds."""
        return self.last_step_error is None

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
        self._add(request_id, prompt_token_ids, params, cache_salt, session_id)

    def _add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        session_id: str | None,
        is_pin: bool = False,
    ) -> None:
        self._validate_prompt(prompt_token_ids)
        grammar = None
        if params.grammar is not None:
            grammar = self.structured.start(params.grammar, params.grammar_prefix)
        seq = self.core.add_request(request_id, prompt_token_ids, params, cache_salt, session_id, is_pin)
        if grammar is not None:
            self.structured.add(request_id, grammar)
        mode = self.config.loop_guard
        guarded = not is_pin and (mode == "all" or (mode == "constrained" and grammar is not None))
        if guarded:
            assert self.loop_guard is not None
            if grammar is not None:
                self.loop_guard.add(request_id, self.structured.json_strings, params.grammar_prefix)
            else:
                self.loop_guard.add(request_id)
        if self.drafter is not None and not is_pin and (params.greedy or params.seed is None):
            # Not for a seeded sampling request: its draws would depend on what the drafts were, so the seed
            # would not reproduce it. Under a grammar or the loop guard, `_draftable` cuts each draft.
            self.drafter.add(request_id, seq.prompt_token_ids, cache_salt, session_id)
        if params.seed is not None:
            self._generators[request_id] = torch.Generator().manual_seed(params.seed)
        self.outputs.add(request_id, seq.prompt_token_ids, params)

    @property
    def structured(self) -> StructuredDecoding:
        """The constrained requests' matchers (the grammar library's vocabulary is built on first use)."""
        if self._structured is None:
            mode, vocab_size = self.config.jump_forward, self.loaded.config.vocab_size
            jump = mode == "on" or (mode == "auto" and self.loaded.device.type != "cpu")
            self._structured = StructuredDecoding(self.tokenizer, vocab_size, jump)
        return self._structured

    def release_session(self, session_id: str) -> bool:
        """End a session: its private pages become the first to be evicted. False if it is not open. A request
        of the session still running finishes normally; its pages then rank as released too."""
        return self.core.release_session(session_id)

    def add_pin(
        self, pin_id: str, prompt_token_ids: list[int], ttl_s: float | None, cache_salt: str | None = None
    ) -> bool:
        """Pin a prefix: queue a one-token prefill of it under `pin_id` (its delta arrives like any request's);
        when it finishes, the prefix's full pages (and a hybrid's state at their end) are held until `ttl_s`
        runs out or `unpin`. True when nothing was queued because the pin is held already: a hybrid's prefix
        cached with its state (see `Pins`); no delta comes then. InvalidRequestError (PinLimitError past
        the cap), and nothing queued or held, if it cannot be pinned."""
        self.pins.check(pin_id, prompt_token_ids, ttl_s)
        prompt = self.pins.prefill_prompt(prompt_token_ids, cache_salt)
        if prompt is None:
            if self.core.get_sequence(pin_id) is not None:
                raise InvalidRequestError(f"request id {pin_id!r} is already in use")
            self._validate_prompt(prompt_token_ids)
            self.pins.add(pin_id, prompt_token_ids, ttl_s, cache_salt)
            self.pins.hold(pin_id, len(prompt_token_ids))
            return True
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        self._add(pin_id, prompt, params, cache_salt, None, is_pin=True)
        self.pins.add(pin_id, prompt_token_ids, ttl_s, cache_salt)
        return False

    def get_pin(self, pin_id: str) -> PinInfo | None:
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
        pool_tokens = (self.kv.num_pages - self.kv.num_pinned) * self.config.block_size
        if len(ids) >= pool_tokens:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; the KV pool holds {pool_tokens} besides pinned pages"
            )

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running, or a step's ids are still to be read."""
        return self.core.has_unfinished() or self._in_flight is not None

    def step(self) -> list[RequestDelta]:
        """Run one batch; return what each request produced (finished requests are forgotten here). With
        async scheduling a step's tokens come out of the next call, which launches the step after it first."""
        plan = self.core.schedule()
        # Every plan reaches the resident page table, one without chunks too: it may only free rows.
        self.runner.update_page_table(plan)
        deltas: list[RequestDelta] = []
        in_flight, self._in_flight = self._in_flight, None
        if plan.chunks:
            deltas += self._run(plan, in_flight)
        elif in_flight is not None:
            deltas += self._settle(in_flight, ran_ahead={})
        for seq in self.scheduler.gave_up:
            deltas.append(self.outputs.process(seq.request_id, seq.output_token_ids, [], "length"))
        self.scheduler.gave_up.clear()
        for delta in deltas:
            if delta.finished:
                finished = self.core.get_sequence(delta.request_id)
                self._forget(delta.request_id)
                self.counters.requests_finished += delta.error is None
                if delta.request_id in self.pins:
                    self._settle_pin(delta, finished.num_cached_tokens if finished is not None else 0)
        return deltas

    def _settle_pin(self, delta: RequestDelta, num_cached_tokens: int) -> None:
        if delta.error is None and delta.finish_reason != "abort":
            self.pins.hold(delta.request_id, num_cached_tokens)
        else:
            self.pins.remove(delta.request_id)

    def _run(self, plan: StepPlan, in_flight: InFlight | None) -> list[RequestDelta]:
        """Compute and sample the plan's chunks; `in_flight`: the step before, launched with its ids on the
        device, whose provisional tokens this plan's decodes compute. Its ids are read (and its deltas
        made) once this step is launched."""
        start = time.perf_counter()
        ran_ahead = {c.request_id: c for c in plan.chunks}
        launched: InFlight | None = None
        try:
            if self.config.check_writes:
                for chunk in plan.chunks:
                    self.kv.check_writable(chunk.request_id, chunk.start, chunk.start + chunk.num_tokens)
            masks = self._structured.prefetch(plan.chunks) if self._structured is not None else None
            provisional = in_flight.inputs() if in_flight is not None else None
            # The masks are computed meanwhile.
            sampling, logits = self.runner.run(plan, provisional)
            if masks is not None:  # every constrained row, a draft's included, before any is verified
                self.structured.apply(masks, sampling, logits)
            generators = [self._generators.get(c.request_id, self._generator) for c in sampling]
            verified = self._verify(sampling, logits, generators) if any(c.draft for c in sampling) else {}
            # The other chunks sample from their one row (a speculative chunk's rows were verified above).
            plain = [i for i in range(len(sampling)) if i not in verified]
            if verified:
                ends = list(itertools.accumulate(c.num_logits for c in sampling))
                rows = torch.tensor([ends[i] - 1 for i in plain], dtype=torch.int64, device=logits.device)
                logits = logits[rows]
            plain_chunks = [sampling[i] for i in plain]
            if self.loop_guard is not None:  # no guarded row of a draft has a penalty (`_draftable`)
                self.loop_guard.apply(plain_chunks, logits)
            params, plain_generators = [c.seq.params for c in plain_chunks], [generators[i] for i in plain]
            sampled: list[int] = []
            if self._looks_ahead(sampling, verified, masks):
                launched = InFlight.start(sampling, sample_on_device(logits, params, plain_generators))
            elif plain:
                sampled = sample(logits, params, plain_generators)
        except Exception as exc:
            # This step computed nothing to keep: a request the step before stopped is freed without it.
            deltas = self._settle(in_flight, {}) if in_flight is not None else []
            return deltas + self._fail_chunks(plan.chunks, exc)
        self.last_step_error = None
        self.counters.lookahead_steps += in_flight is not None
        deltas = self._settle(in_flight, ran_ahead) if in_flight is not None else []
        self._time_prefill(plan, time.perf_counter() - start)
        # A request the step before finished computed this step for nothing: it has nothing to commit.
        self.core.commit([c for c in plan.chunks if c.seq.status is Status.RUNNING])
        if launched is not None:
            live = [c for c in launched.sampling if c.seq.status is Status.RUNNING]
            for chunk in live:
                chunk.seq.append_provisional()
            if live:
                self._in_flight = launched
            self.core.end_step()
            return deltas
        tokens = dict(zip(plain, sampled, strict=True))
        deltas += [
            self._append_verified(chunk, verified[i])
            if i in verified
            else self._append_token(chunk, tokens[i])
            for i, chunk in enumerate(sampling)
            if chunk.seq.status is Status.RUNNING
        ]
        self.core.end_step()
        return deltas

    def _looks_ahead(
        self, sampling: list[Chunk], verified: dict[int, list[int]], masks: object | None
    ) -> bool:
        """Whether the next step may be scheduled before this one's ids are read: async scheduling is on and
        nothing the next schedule does needs them. Drafts are verified on the host; a grammar's mask and the
        loop guard's penalty follow the last token; so does a draft, unless the request's drafts are
        backing off (its next proposal is skipped unread)."""
        if not self.lookahead or verified or masks is not None or not sampling:
            return False
        structured, guard, drafter = self._structured, self.loop_guard, self.drafter
        for chunk in sampling:
            rid = chunk.request_id
            if (structured is not None and rid in structured) or (guard is not None and rid in guard):
                return False
            if drafter is not None and not drafter.backing_off(rid):
                return False
        return True

    def _settle(self, in_flight: InFlight, ran_ahead: dict[str, Chunk]) -> list[RequestDelta]:
        """Read a launched step's ids and append them in place of its provisional tokens (stop strings,
        finishes, deltas as in a synchronous step). `ran_ahead`: the chunks of the step launched after it, by
        request. If the ids cannot be read, the step's requests fail."""
        try:
            tokens = in_flight.tokens()
        except Exception as exc:
            return self._fail_chunks(in_flight.sampling, exc)
        deltas = []
        for chunk, token in zip(in_flight.sampling, tokens, strict=True):
            seq = chunk.seq
            if seq.num_provisional_tokens:
                seq.drop_provisional()
            if seq.status is Status.FINISHED:  # aborted, failed or given up meanwhile
                if seq in self.scheduler.gave_up:  # its reply keeps the token; the step's loop ends it
                    seq.append_token(token)
                    deltas.append(self.outputs.process(seq.request_id, seq.output_token_ids, [token], None))
                continue  # aborted or failed: the token was never shown, so the reply ends without it
            deltas.append(self.append_tokens(seq, [token], ran_ahead=ran_ahead.get(chunk.request_id)))
        return deltas

    def _verify(
        self, sampling: list[Chunk], logits: torch.Tensor, generators: list[torch.Generator]
    ) -> dict[int, list[int]]:
        """The tokens each speculative chunk yields (by its index in `sampling`), from its rows of logits."""
        out: dict[int, list[int]] = {}
        choices = (
            greedy_ids(logits).tolist() if any(c.draft and c.seq.params.greedy for c in sampling) else []
        )
        first = 0
        for i, chunk in enumerate(sampling):
            rows = slice(first, first + chunk.num_logits)
            first += chunk.num_logits
            if not chunk.draft:
                continue
            if chunk.seq.params.greedy:
                out[i] = verify_greedy(choices[rows], chunk.draft)
            else:
                out[i] = verify_sampled(logits[rows], chunk.draft, chunk.seq.params, generators[i])
        return out

    def _append_verified(self, chunk: Chunk, tokens: list[int]) -> RequestDelta:
        """Append a speculative chunk's yield: its accepted draft tokens, whose KV the chunk computed, and one."""
        num_accepted = len(tokens) - 1
        c = self.counters
        c.spec_verify_steps += 1
        c.spec_draft_tokens += len(chunk.draft)
        c.spec_accepted_tokens += num_accepted
        assert self.drafter is not None
        source = self.drafter.record(chunk.request_id, len(chunk.draft), num_accepted)
        c.spec_accepted_sibling_tokens += num_accepted if source == "sibling" else 0
        c.spec_accepted_session_tokens += num_accepted if source == "session" else 0
        tokens, complete = self._under_grammar(chunk.request_id, tokens)
        return self.append_tokens(
            chunk.seq, tokens, grammar_complete=complete, num_computed=num_accepted, drafted=True
        )

    def _under_grammar(self, request_id: str, tokens: list[int]) -> tuple[list[int], bool]:
        """What a step's tokens append under the request's grammar (a forced run after them, or a queued
        forced token instead), and whether the grammar has ended; the tokens as they are without one."""
        structured = self._structured
        if structured is None or request_id not in structured:
            return tokens, False
        appended = structured.advance(request_id, tokens)
        return appended, structured.is_complete(request_id)

    def _draftable(self, request_id: str, tokens: tuple[int, ...]) -> int:
        """How many of a draft's first tokens the request's next step may verify: those its grammar allows
        before any forced run, within what the loop guard leaves free of penalties."""
        num_tokens = len(tokens)
        limit = self.loop_guard.draftable(request_id) if self.loop_guard is not None else None
        if limit is not None:
            num_tokens = min(num_tokens, limit)
        if self._structured is not None and num_tokens:
            num_tokens = self._structured.draftable(request_id, tokens[:num_tokens])
        return num_tokens

    def _time_prefill(self, plan: StepPlan, elapsed_s: float) -> None:
        """Refine the per-token prefill cost that swap-or-recompute decisions weigh, from a prefill step."""
        num_tokens = sum(c.num_tokens for c in plan.chunks)
        if num_tokens >= 16 and any(c.kind == "prefill" for c in plan.chunks):
            cost = self.preemption_cost
            cost.prefill_s_per_token = 0.8 * cost.prefill_s_per_token + 0.2 * elapsed_s / num_tokens

    def _fail_chunks(self, chunks: list[Chunk], exc: Exception) -> list[RequestDelta]:
        """Fail a step's requests and only those: their KV computed in earlier steps stays cached."""
        log.exception("a step of %d chunk(s) failed; failing its requests", len(chunks))
        self.last_step_error = f"{type(exc).__name__}: {exc}"
        self.counters.failed_steps += 1
        chunks = [c for c in chunks if c.seq.status is not Status.FINISHED]
        self.runner.page_table.drop([c.request_id for c in chunks])  # their rows go with them
        deltas = []
        for chunk in chunks:
            if chunk.seq.num_provisional_tokens:
                chunk.seq.drop_provisional()
            self.core.finish(chunk.seq, "error")
            self.counters.requests_failed += 1
            deltas.append(
                self.outputs.fail(chunk.request_id, "the engine failed while computing this request")
            )
        return deltas

    def _append_token(self, chunk: Chunk, sampled: int) -> RequestDelta:
        """Append what the step produced: the sampled token, or under a grammar what it forces too."""
        tokens, complete = self._under_grammar(chunk.request_id, [sampled])
        return self.append_tokens(chunk.seq, tokens, grammar_complete=complete)

    def append_tokens(
        self,
        seq: Sequence,
        tokens: list[int],
        grammar_complete: bool = False,
        num_computed: int = 0,
        drafted: bool = False,
        ran_ahead: Chunk | None = None,
    ) -> RequestDelta:
        """The multi-token append: add `tokens` to a running request's reply, up to the first that ends it
        (a stop id, max_tokens, the context). The next step computes those past the first as one chunk, as a
        prefill's chunk is computed, so the KV and the prefix cache stay exact; forced runs (jump-forward)
        come through here, and a speculative step's yield: its first `num_computed` tokens are accepted
        draft tokens, whose KV that step computed, so they count as computed at once (`drafted`: a hybrid's
        recurrent state is rewound to them). `grammar_complete`: nothing may follow (the reply's grammar
        ended), so the request stops. `ran_ahead`: the chunk a step launched since computes for the request
        (async scheduling, `tokens` its input): if the request stops here, that chunk is committed first, so
        its KV and a hybrid's state, both past the last token, count as computed when it is freed."""
        params = seq.params
        reason: FinishReason | None = None
        appended: list[int] = []
        for token in tokens:
            seq.append_token(token)
            appended.append(token)
            if token in params.stop_token_ids or (
                not params.ignore_eos and token in self.tokenizer.eos_token_ids
            ):
                reason = "stop"
            elif seq.reached_length(self.max_model_len):
                reason = "length"
            if reason is not None:
                break
        if reason is None and grammar_complete:
            reason = "stop"
        delta = self.outputs.process(seq.request_id, seq.output_token_ids, appended, reason)
        if len(delta.new_token_ids) < len(appended):  # a stop string ended the reply inside them
            seq.take_back(len(appended) - len(delta.new_token_ids))
            appended = delta.new_token_ids
        num_accepted = min(num_computed, len(appended))
        if drafted and self.states is not None:
            # Before a finish snapshots it: the state after the chunk's last token and the accepted drafts.
            self.states.rewind(self.kv.state_slots([seq.request_id])[seq.request_id], 1 + num_accepted)
        self.core.accept(seq, num_accepted)
        if self.drafter is not None:
            self.drafter.extend(seq.request_id, appended)
        if self.loop_guard is not None:
            self.loop_guard.extend(seq.request_id, appended)
        self.counters.generated_tokens += 0 if seq.is_pin else len(appended)  # a pin's token is dropped
        if delta.finished:
            assert delta.finish_reason is not None
            if ran_ahead is not None:
                self.core.commit([ran_ahead])
            self.core.finish(seq, delta.finish_reason)
        return delta

    def _forget(self, request_id: str) -> None:
        self.core.forget(request_id)
        if self.drafter is not None:
            self.drafter.finish(request_id)
        self._generators.pop(request_id, None)
        if self._structured is not None:
            self._structured.drop(request_id)
        if self.loop_guard is not None:
            self.loop_guard.drop(request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a request and release its pages; False if it is unknown or already finished."""
        if not self.core.abort(request_id):
            return False
        self.outputs.drop(request_id)
        if self.drafter is not None:
            self.drafter.finish(request_id)
        self._generators.pop(request_id, None)
        if self._structured is not None:
            self._structured.drop(request_id)
        if self.loop_guard is not None:
            self.loop_guard.drop(request_id)
        return True

    def get_sequence(self, request_id: str) -> Sequence | None:
        """The live sequence of a request, if any."""
        return self.core.get_sequence(request_id)

    def check_integrity(self) -> None:
        """Assert that pages, refcounts, page tables, the prefix index and the runner's rows agree."""
        self.core.check_integrity()
        # Rows of requests freed since the last plan go with the next one.
        live = {s.request_id for s in self.scheduler.running} | set(self.scheduler.freed_since_plan)
        rows = self.runner.page_table.request_ids
        assert rows <= live, f"rows of stopped requests: {sorted(rows - live)}"
        for seq in self.scheduler.running:
            have = self.runner.page_table.pages(seq.request_id)
            assert have == list(self.kv.page_table(seq.request_id)), (
                f"{seq.request_id}: the runner's row is stale"
            )

    def snapshot(self) -> EngineStats:
        """KV and work counters, in pages, bytes and tokens: the typed form every reader uses."""
        stats = self.core.snapshot()
        structured, guard = self._structured, self.loop_guard
        return dataclasses.replace(
            stats,
            grammars_compiled=structured.grammars.num_compiled if structured is not None else 0,
            grammar_cache_hits=structured.grammars.num_hits if structured is not None else 0,
            forced_tokens=structured.num_forced_tokens if structured is not None else 0,
            loop_guard_penalties=guard.num_penalised if guard is not None else 0,
            loop_guard_closing=guard.num_closing if guard is not None else 0,
        )

    def stats(self) -> dict[str, Any]:
        """`snapshot()` as a flat dict (the public API), with a GGUF's weights per type as held."""
        out = self.snapshot().to_dict()
        report = self.loaded.weight_report
        if report is not None:
            out["weights"] = report.to_json()
        return out
