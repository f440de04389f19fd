"""OpenAI request bodies -> typed requests; every client mistake becomes an APIError with OpenAI's error shape.

This module holds the error, the fields both generation endpoints share, and the completions body;
`chat_request` holds the chat body (messages, tools, tool_choice).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from swarmkv.core.sampling_params import SamplingParams
from swarmkv.errors import InvalidRequestError


class APIError(Exception):
    """An error the client gets as `{"error": {message, type, param, code}}` with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
        details: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type
        self.details = details  # machine-readable specifics, for APIs whose errors carry them (Anthropic's)

    def to_json(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 invalid_request_error."""
    return APIError(400, message, param=param, code=code)


_JSON_TYPE_NAMES: dict[type, str] = {dict: "object", list: "array", str: "string", bool: "boolean"}


def type_name(value: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    return "null" if value is None else _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def get_field(
    body: dict[str, Any], name: str, kind: type | tuple[type, ...], what: str, default: Any = None
) -> Any:
    """`body[name]` if it is present and of `kind` (bool never counts as a number), else a 400."""
    value = body.get(name)
    if value is None:
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        raise bad_request(f"'{name}' must be {what}, got {type_name(value)}", param=name)
    return value


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # the decoder recurses once per nesting level
        raise bad_request("the request body's JSON is nested too deeply") from exc
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type_name(body)}")
    return body


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

    def sampling_params(
        self, num_prompt_tokens: int, max_model_len: int, prompt_param: str, extra_stop: tuple[str, ...] = ()
    ) -> SamplingParams:
        """Engine settings for a prompt of `num_prompt_tokens`; a 400 when prompt and reply overflow the context."""
        if num_prompt_tokens >= max_model_len:
            raise bad_request(
                f"this model's maximum context length is {max_model_len} tokens, and the prompt alone has "
                f"{num_prompt_tokens}; shorten the {prompt_param}",
                param=prompt_param,
                code="context_length_exceeded",
            )
        max_tokens = self.max_tokens if self.max_tokens is not None else max_model_len - num_prompt_tokens
        if num_prompt_tokens + max_tokens > max_model_len:
            raise bad_request(
                f"this model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens + max_tokens} "
                f"were requested ({num_prompt_tokens} in the prompt, {max_tokens} for the completion); lower max_tokens",
                param="max_tokens",
                code="context_length_exceeded",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                seed=self.seed,
                stop=self.stop + extra_stop,
                ignore_eos=self.ignore_eos,
            )
        except InvalidRequestError as exc:
            raise bad_request(str(exc)) from exc


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
    )


# The header a client (or a proxy in front of a swarm) may name a session with instead of the body field.
SESSION_HEADER = "x-session-id"
MAX_SESSION_ID_CHARS = 256


def check_session_id(value: Any, where: str) -> str | None:
    """A session id: None when absent, else a non-empty string of at most 256 characters, or a 400."""
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_SESSION_ID_CHARS:
        got = f"{len(value)} characters" if isinstance(value, str) else type_name(value)
        raise bad_request(
            f"{where} must be a non-empty string of at most {MAX_SESSION_ID_CHARS} characters, got {got}",
            param="session_id",
        )
    return value


def resolve_session_id(body_value: str | None, header_value: str | None) -> str | None:
    """The request's session: the body's `session_id` wins over the `X-Session-Id` header; both are checked.

    The body names the request itself, while a header may be set for a whole connection by a proxy or
    client default, so the more specific one wins.
    """
    header = check_session_id(header_value, "the X-Session-Id header")
    return body_value if body_value is not None else header


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Fields whose non-default values this server cannot honour: a 400 rather than a silently different reply."""
    if get_field(body, "n", int, "an integer", 1) != 1:
        raise bad_request("only n=1 is supported", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if get_field(body, name, (int, float), "a number", 0) != 0:
            raise bad_request(f"'{name}' is not supported", param=name)
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad_request("logprobs are not supported", param="logprobs")
    response_format = get_field(body, "response_format", dict, "an object")
    if response_format is not None and response_format.get("type") != "text":
        raise bad_request("only the 'text' response_format is supported", param="response_format")


@dataclass(frozen=True)
class CompletionRequest:
    """A validated /v1/completions body: one prompt, as text or token ids."""

    options: Options
    prompt: str | list[int]


def parse_completion_request(body: dict[str, Any]) -> CompletionRequest:
    """Validate a completions body."""
    options = parse_options(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not isinstance(prompt, str) and not (is_ids and prompt):
        raise bad_request(
            "'prompt' must be a string or a non-empty array of token ids (one prompt per request)",
            param="prompt",
        )
    if (
        body.get("echo")
        or body.get("suffix") is not None
        or get_field(body, "best_of", int, "an integer", 1) != 1
    ):
        raise bad_request("echo, suffix and best_of are not supported", param="prompt")
    return CompletionRequest(options, prompt)
