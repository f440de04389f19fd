"""LLMEngine: the incremental interface (add_request, step, abort) over scheduler, runner and caches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from swarmkv.engine.kv_cache import KVCache
from swarmkv.engine.runner import ModelRunner
from swarmkv.engine.sampler import sample
from swarmkv.engine.sampling_params import SamplingParams
from swarmkv.engine.scheduler import Scheduler, SchedulerLimits
from swarmkv.engine.sequence import FinishReason, Sequence
from swarmkv.engine.stats import EngineCounters
from swarmkv.errors import CapacityError, InvalidRequestError
from swarmkv.kv import NoSharingCache, PagePool, PrefixCache, RadixCache
from swarmkv.models.loader import LoadedModel
from swarmkv.tokenizer import IncrementalDetokenizer


@dataclass(frozen=True)
class EngineConfig:
    """Sizes and switches of one engine; `max_model_len` None means the model's own context."""

    kv_cache_bytes: int
    block_size: int = 16
    prefix_caching: bool = True
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    cascade_attention: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_cache_bytes", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")


@dataclass(frozen=True)
class RequestDelta:
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    text: str = ""
    num_text_emitted: int = 0
    num_text_checked: int = 0  # text before this offset holds no stop string
    error: str | None = None


class LLMEngine:
    """Steps every live request forward together; each step computes one batch of chunks."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        model = loaded.model
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.config = config
        self.kv_bytes_per_token = loaded.config.kv_bytes_per_token(loaded.dtype)
        page_bytes = self.kv_bytes_per_token * config.block_size
        num_pages = config.kv_cache_bytes // page_bytes
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
        pool = PagePool(num_pages)
        self.cache: PrefixCache = (
            RadixCache(pool, config.block_size)
            if config.prefix_caching
            else NoSharingCache(pool, config.block_size)
        )
        self.counters = EngineCounters()
        limits = SchedulerLimits(config.max_num_seqs, config.max_num_batched_tokens)
        self.scheduler = Scheduler(self.cache, config.block_size, limits, self.counters)
        kv = KVCache(loaded.config, num_pages, config.block_size, loaded.dtype, loaded.device)
        self.runner = ModelRunner(model, kv, loaded.device, cascade=config.cascade_attention)
        self._requests: dict[str, _Request] = {}
        self._generator = torch.Generator().manual_seed(config.seed)
        self._arrivals = 0

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request; InvalidRequestError (and nothing queued) if it cannot ever run."""
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self._validate_prompt(prompt_token_ids)
        self._arrivals += 1
        seq = Sequence(request_id, list(prompt_token_ids), params, cache_salt, arrival=self._arrivals)
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids)
        self._requests[request_id] = _Request(seq, detokenizer, generator)
        self.counters.prompt_tokens += len(prompt_token_ids)
        self.scheduler.add(seq)

    def _validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.loaded.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; the context holds {self.max_model_len} including the reply"
            )
        pool_tokens = self.cache.pool.num_pages * self.config.block_size
        if len(ids) >= pool_tokens:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens; the whole KV pool holds {pool_tokens}"
            )

    def has_unfinished(self) -> bool:
        """Whether any request is waiting or running."""
        return self.scheduler.has_work()

    def step(self) -> list[RequestDelta]:
        """Run one batch; return what each request produced (finished requests are forgotten here)."""
        chunks = self.scheduler.schedule()
        deltas: list[RequestDelta] = []
        if chunks:
            sampling, logits = self.runner.run(chunks)
            self.scheduler.commit(chunks)
            states = [self._requests[c.seq.request_id] for c in sampling]
            tokens = sample(
                logits, [s.seq.params for s in states], [s.generator or self._generator for s in states]
            )
            for state, token in zip(states, tokens, strict=True):
                deltas.append(self._append_token(state, token))
            self.counters.steps += 1
            self._track_peaks()
        for seq in self.scheduler.gave_up:
            state = self._requests[seq.request_id]
            state.text += state.detokenizer.flush(seq.output_token_ids)
            deltas.append(self._delta(state, [], True))
        self.scheduler.gave_up.clear()
        for delta in deltas:
            if delta.finished:
                self._requests.pop(delta.request_id, None)
                self.counters.requests_finished += 1
        return deltas

    def _append_token(self, state: _Request, token: int) -> RequestDelta:
        seq = state.seq
        seq.output_token_ids.append(token)
        self.counters.generated_tokens += 1
        params = seq.params
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.tokenizer.eos_token_ids
        state.text += state.detokenizer.step(seq.output_token_ids)
        reason: FinishReason | None = None
        if token in stop_ids:
            reason = "stop"
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            state.text += state.detokenizer.flush(seq.output_token_ids)
        if self._cut_at_stop_string(state):
            reason = "stop"
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return self._delta(state, [token], reason is not None)

    def _cut_at_stop_string(self, state: _Request) -> bool:
        stops = state.seq.params.stop
        if not stops:
            return False
        # A stop string may straddle the checked text and the new piece: back up by the longest one.
        start = max(0, state.num_text_checked - max(len(s) for s in stops) + 1)
        state.num_text_checked = len(state.text)
        hits = [i for s in stops if (i := state.text.find(s, start)) >= 0]
        if not hits:
            return False
        state.text = state.text[: min(hits)]
        return True

    def _delta(self, state: _Request, tokens: list[int], finished: bool) -> RequestDelta:
        # Hold back a possible stop-string prefix until the request finishes, so streamed text is never retracted.
        holdback = 0 if finished else max((len(s) - 1 for s in state.seq.params.stop), default=0)
        upto = max(state.num_text_emitted, len(state.text) - holdback)
        new_text = state.text[state.num_text_emitted : upto]
        state.num_text_emitted = upto
        return RequestDelta(state.seq.request_id, tokens, new_text, finished, state.seq.finish_reason)

    def abort(self, request_id: str) -> bool:
        """Stop a request and release its pages; False if it is unknown or already finished."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        self.scheduler.finish(state.seq, "abort")
        return True

    def get_sequence(self, request_id: str) -> Sequence | None:
        """The live sequence of a request, if any."""
        state = self._requests.get(request_id)
        return state.seq if state else None

    def _track_peaks(self) -> None:
        c = self.counters
        pool = self.cache.pool
        c.peak_kv_pages_in_use = max(c.peak_kv_pages_in_use, pool.num_held)
        c.peak_kv_pages_used = max(c.peak_kv_pages_used, pool.num_pages - pool.num_free)

    def check_integrity(self) -> None:
        """Assert that pages, refcounts, page tables and the prefix index agree."""
        self.cache.check_integrity([s.page_table for s in self.scheduler.running])
        for seq in self.scheduler.waiting:
            assert not seq.page_table, f"waiting sequence {seq.request_id} holds pages"

    def stats(self) -> dict[str, Any]:
        """KV and work counters, in pages, bytes and tokens."""
        pool, c = self.cache.pool, self.counters
        logical_pages = sum(len(s.page_table) for s in self.scheduler.running)
        return {
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "block_size": self.config.block_size,
            "kv_pages_total": pool.num_pages,
            "kv_pages_in_use": pool.num_held,
            "kv_pages_cached": self.cache.num_cached,
            "kv_pages_free": pool.num_free,
            "kv_bytes_in_use": pool.num_held * self.page_bytes,
            "kv_bytes_cached": self.cache.num_cached * self.page_bytes,
            "kv_bytes_logical": logical_pages * self.page_bytes,
            "kv_bytes_used": (pool.num_pages - pool.num_free) * self.page_bytes,
            "peak_kv_bytes_in_use": c.peak_kv_pages_in_use * self.page_bytes,
            "peak_kv_bytes_used": c.peak_kv_pages_used * self.page_bytes,
            "prompt_tokens": c.prompt_tokens,
            "prefill_tokens_computed": c.prefill_tokens_computed,
            "prefix_hit_tokens": c.prefix_hit_tokens,
            "generated_tokens": c.generated_tokens,
            "preemptions": c.preemptions,
            "evictions": self.cache.num_evictions,
            "requests_running": len(self.scheduler.running),
            "requests_waiting": len(self.scheduler.waiting),
            "requests_finished": c.requests_finished,
            "steps": c.steps,
        }
