"""LLM: the offline API. Load a model once, then generate for many prompts at once."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

import swarmkv.resolve as resolve
from swarmkv.choices import WeightsOption
from swarmkv.core.config import EngineConfig, ModelOptions
from swarmkv.core.pins import PinInfo
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.sequence import FinishReason
from swarmkv.engine.engine import LLMEngine
from swarmkv.errors import InvalidRequestError, SwarmkvError
from swarmkv.models.loader import LoadedModel, load_model

Message = dict[str, Any]
Prompt = str | list[int] | list[Message]


@dataclass(frozen=True)
class RequestOutput:
    """One prompt's finished result; `error` is set (and nothing generated) if the request was refused."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    num_cached_tokens: int
    error: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt after templating."""
        return len(self.prompt_token_ids)


class LLM:
    """An engine over one model: `generate()` runs prompts to completion with continuous batching."""

    def __init__(
        self,
        model: str | None = ModelOptions.model,
        *,
        dtype: str | torch.dtype = ModelOptions.dtype,
        device: str | torch.device = ModelOptions.device,
        weights: WeightsOption = ModelOptions.weights,
        loaded: LoadedModel | None = None,
        **engine_options: Any,
    ) -> None:
        """Load `model` (or take `loaded`); `engine_options` are EngineConfig's fields (kv_cache_memory,
        block_size, prefix_caching, max_num_seqs, max_num_batched_tokens, max_model_len,
        cascade_attention, attention_backend, enforce_eager, seed), with its defaults."""
        config = EngineConfig.from_kwargs(**engine_options)
        mtp = resolve.mtp_drafts(config.speculation, config.speculative_method)
        self.loaded = loaded or load_model(model, dtype=dtype, device=device, weights=weights, mtp=mtp)
        self.tokenizer = self.loaded.tokenizer
        self.engine = LLMEngine(self.loaded, config)
        self._ids = itertools.count()

    def encode_prompt(
        self, prompt: Prompt, tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of a prompt: raw text, chat messages (templated) or ids as given."""
        if isinstance(prompt, str):
            return self.tokenizer.encode_text_prompt(prompt)
        if prompt and all(isinstance(m, dict) for m in prompt):
            text = self.tokenizer.apply_chat_template(
                list(prompt),  # type: ignore[arg-type]
                tools=tools,
                add_generation_prompt=add_generation_prompt,
            )
            return self.tokenizer.encode(text, add_special_tokens=False)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)  # type: ignore[arg-type]
        raise InvalidRequestError("a prompt is a string, a list of chat messages or a list of token ids")

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | Sequence[str | None] | None = None,
        session_id: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order. A `session_id` makes each
        prompt its session's newest turn (see `release_session`)."""
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params or SamplingParams(), len(batch), SamplingParams)
        salts = _per_prompt(cache_salt, len(batch), str)
        sessions = _per_prompt(session_id, len(batch), str)
        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        prompt_ids: dict[str, list[int]] = {}
        for prompt, p, salt, session in zip(batch, params, salts, sessions, strict=True):
            rid = f"gen-{next(self._ids)}"
            order.append(rid)
            try:
                prompt_ids[rid] = self.encode_prompt(prompt)
                self.engine.add_request(rid, prompt_ids[rid], p, cache_salt=salt, session_id=session)
            except SwarmkvError as exc:
                results[rid] = RequestOutput(rid, prompt_ids.get(rid, []), [], "", None, 0, error=str(exc))
        texts: dict[str, list[str]] = {rid: [] for rid in order}
        live = {rid: self.engine.get_sequence(rid) for rid in order if rid not in results}
        while any(rid not in results for rid in order) and self.engine.has_unfinished():
            for delta in self.engine.step():
                if delta.request_id not in texts:
                    continue  # a request added through the engine directly: not ours to collect
                texts[delta.request_id].append(delta.new_text)
                if delta.finished:
                    seq = live[delta.request_id]
                    assert seq is not None
                    results[delta.request_id] = RequestOutput(
                        delta.request_id,
                        seq.prompt_token_ids,
                        seq.settled_output_token_ids,
                        "".join(texts[delta.request_id]),
                        delta.finish_reason,
                        seq.num_cached_tokens,
                        error=delta.error,
                    )
        for rid in order:  # aborted through the engine while we ran
            if rid not in results:
                seq = live[rid]
                assert seq is not None
                results[rid] = RequestOutput(
                    rid,
                    seq.prompt_token_ids,
                    seq.settled_output_token_ids,
                    "".join(texts[rid]),
                    "abort",
                    seq.num_cached_tokens,
                )
        return [results[rid] for rid in order]

    def release_session(self, session_id: str) -> bool:
        """End a session: its private pages become the first to be evicted. False if it is not open."""
        return self.engine.release_session(session_id)

    def pin(
        self,
        prompt: Prompt,
        ttl_s: float | None = None,
        tools: list[dict[str, Any]] | None = None,
        cache_salt: str | None = None,
    ) -> PinInfo:
        """Compute a prefix (text, chat messages with `tools`, or ids) and hold its pages until `ttl_s`
        runs out or `unpin`; PinLimitError past max_pinned_memory."""
        pin_id = f"pin-{next(self._ids)}"
        ids = self.encode_prompt(prompt, tools, add_generation_prompt=False)  # a head, not a turn
        self.engine.add_pin(pin_id, ids, ttl_s, cache_salt)
        while self.engine.get_sequence(pin_id) is not None:
            self.engine.step()
        info = self.engine.get_pin(pin_id)
        if info is None:
            raise SwarmkvError(f"the prefill of pin {pin_id} failed; the pin was not made")
        return info

    def unpin(self, pin_id: str) -> bool:
        """Let a pin's pages go; False if there is no such pin."""
        return self.engine.unpin(pin_id)

    def stats(self) -> dict[str, Any]:
        """The engine's KV and work counters."""
        return self.engine.stats()


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(x, dict | int) for x in items):
        return [items]  # one chat or one token-id prompt
    return items


def _per_prompt(value: Any, n: int, kind: type) -> list[Any]:
    if value is None or isinstance(value, kind):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise InvalidRequestError(f"got {len(values)} per-prompt values for {n} prompts")
    return values
