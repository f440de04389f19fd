"""The fields every generation body shares (model, stream, sampling, stop, cache salt, session), validated.

Chat completions and completions parse them from their own bodies; Messages and Responses rewrite theirs
into a chat completions body first, so every protocol's sampling is validated here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from swarmkv.api.errors import APIError, bad_request, get_field
from swarmkv.api.limits import check_num_stops
from swarmkv.api.session_id import check_session_id
from swarmkv.api.structured_request import Constraint, parse_response_format
from swarmkv.choices import MaxTokensPolicy
from swarmkv.core.sampling_params import LOGIT_BIAS_RANGE, PENALTY_RANGE, SamplingParams
from swarmkv.errors import InvalidRequestError

# A bound of ours (OpenAI documents none): each entry is one more index the sampler writes every step.
MAX_LOGIT_BIAS = 1024


@dataclass(frozen=True)
class Penalties:
    """The fields that change the logits or cut the distribution beyond temperature, top-p and top-k."""

    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class Options:
    """The fields both generation endpoints share, validated."""

    model: str | None
    stream: bool
    include_usage: bool
    max_tokens: int | None  # None: whatever the context leaves after the prompt
    temperature: float
    top_p: float
    top_k: int | None
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    cache_salt: str | None
    session_id: str | None  # the body's; see resolve_session_id for the header
    # OpenAI's `prompt_cache_key` (chat completions and Responses): the session when nothing else names one.
    prompt_cache_key: str | None = None
    penalties: Penalties = Penalties()

    def sampling_params(
        self,
        num_prompt_tokens: int,
        max_model_len: int,
        prompt_param: str,
        extra_stop: tuple[str, ...] = (),
        max_tokens_policy: MaxTokensPolicy = "clamp",
        constraint: Constraint | None = None,
    ) -> SamplingParams:
        """Engine settings for a prompt of `num_prompt_tokens`: a 400 when the prompt alone fills the context;
        a max_tokens past what the context leaves is clamped to it, or a 400 under the "refuse" policy.

        Harnesses ask for their own default (Qwen Code and Claude Code 32000) whatever the model's context,
        so "clamp" is the server's default (`--max-tokens-policy`); no max_tokens at all means the room too.
        """
        if num_prompt_tokens >= max_model_len:
            raise context_length_exceeded(max_model_len, str(num_prompt_tokens), prompt_param)
        room = max_model_len - num_prompt_tokens
        max_tokens = self.max_tokens if self.max_tokens is not None else room
        if max_tokens > room and max_tokens_policy == "refuse":
            raise bad_request(
                f"this model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens + max_tokens} "
                f"were requested ({num_prompt_tokens} in the prompt, {max_tokens} for the completion); lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        max_tokens = min(max_tokens, room)
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.penalties.min_p,
                presence_penalty=self.penalties.presence_penalty,
                frequency_penalty=self.penalties.frequency_penalty,
                repetition_penalty=self.penalties.repetition_penalty,
                logit_bias=self.penalties.logit_bias,
                seed=self.seed,
                stop=self.stop + extra_stop,
                ignore_eos=self.ignore_eos,
                grammar=constraint.grammar if constraint is not None else None,
                grammar_prefix=constraint.prefix if constraint is not None else "",
            )
        except InvalidRequestError as exc:
            raise bad_request(str(exc)) from exc


def context_length_exceeded(max_model_len: int, num_prompt_tokens: str, prompt_param: str) -> APIError:
    """The 400 for a prompt that alone fills the context; `num_prompt_tokens` as the message words it."""
    return bad_request(
        f"this model's maximum context length is {max_model_len} tokens, and the prompt alone has "
        f"{num_prompt_tokens}; shorten the {prompt_param}",
        param=prompt_param,
        code="context_length_exceeded",
    )


def parse_options(body: dict[str, Any]) -> Options:
    """Validate the fields both generation endpoints share."""
    model = get_field(body, "model", str, "a string")
    stream = get_field(body, "stream", bool, "a boolean", False)
    stream_options = get_field(body, "stream_options", dict, "an object")
    if stream_options is not None and not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    include_usage = get_field(stream_options or {}, "include_usage", bool, "a boolean", False)
    max_tokens = get_field(body, "max_completion_tokens", int, "an integer")
    if max_tokens is None:
        max_tokens = get_field(body, "max_tokens", int, "an integer")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    temperature = float(get_field(body, "temperature", (int, float), "a number", 1.0))
    if not 0 <= temperature <= 2:
        raise bad_request(f"temperature must be between 0 and 2, got {temperature}", param="temperature")
    top_p = float(get_field(body, "top_p", (int, float), "a number", 1.0))
    if not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    top_k = get_field(body, "top_k", int, "an integer")  # vLLM's extension; -1 and 0 mean no limit there
    stop_value = get_field(body, "stop", (str, list), "a string or an array of strings")
    stop = (stop_value,) if isinstance(stop_value, str) else tuple(stop_value or ())
    check_num_stops(len(stop))  # counted before any is read: a step checks each against the text
    if any(not isinstance(s, str) or not s for s in stop):
        raise bad_request("'stop' must be a non-empty string or an array of non-empty strings", param="stop")
    cache_salt = get_field(body, "cache_salt", str, "a string")
    if cache_salt == "":
        raise bad_request("'cache_salt' must be a non-empty string", param="cache_salt")
    _refuse_unsupported(body)
    return Options(
        model=model,
        stream=stream,
        include_usage=include_usage,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k if top_k is not None and top_k > 0 else None,
        seed=get_field(body, "seed", int, "an integer"),
        stop=stop,
        ignore_eos=get_field(body, "ignore_eos", bool, "a boolean", False),
        cache_salt=cache_salt,
        session_id=check_session_id(body.get("session_id"), "'session_id'"),
        prompt_cache_key=check_session_id(body.get("prompt_cache_key"), "'prompt_cache_key'"),
        penalties=parse_penalties(body),
    )


def parse_penalties(body: dict[str, Any]) -> Penalties:
    """`min_p`, OpenAI's presence and frequency penalties and logit bias, vLLM's repetition penalty; a number
    out of its range (NaN and infinities included) is a 400 naming the field."""
    return Penalties(
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0, "in [0, 1]"),
        presence_penalty=_number(body, "presence_penalty", 0.0, *PENALTY_RANGE, "in [-2, 2]"),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, *PENALTY_RANGE, "in [-2, 2]"),
        repetition_penalty=_number(
            body, "repetition_penalty", 1.0, sys.float_info.min, sys.float_info.max, "a finite number > 0"
        ),
        logit_bias=_logit_bias(body),
    )


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float, what: str) -> float:
    """A numeric field within [low, high] (NaN is within no range), else a 400."""
    value = float(get_field(body, name, (int, float), "a number", default))
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be {what}, got {value}", param=name)
    return value


def _logit_bias(body: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: token ids (as JSON keys, decimal strings) to a number in [-100, 100]. Ids past
    the model's vocabulary are the engine's 400 (it knows the logits' width)."""
    raw = get_field(body, "logit_bias", dict, "an object mapping token ids to numbers", {})
    if len(raw) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens, got {len(raw)}", param="logit_bias"
        )
    bias: dict[int, float] = {}
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise bad_request(
                f"'logit_bias' keys must be token ids (0, 1, ...), got {key!r}", param="logit_bias"
            )
        low, high = LOGIT_BIAS_RANGE
        if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
            raise bad_request(
                f"'logit_bias' values must be numbers in [-100, 100], got {value!r} for token {key}",
                param="logit_bias",
            )
        bias[int(key)] = float(value)
    return tuple(sorted(bias.items()))


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Fields whose non-default values this server cannot honour: a 400 rather than a silently different reply."""
    if get_field(body, "n", int, "an integer", 1) != 1:
        raise bad_request("only n=1 is supported", param="n")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad_request("logprobs are not supported", param="logprobs")
    parse_response_format(body)  # checked here for every endpoint; a chat request keeps it (ChatRequest)
