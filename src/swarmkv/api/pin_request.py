"""The POST /v1/cache/pin body: a prefix to hold in the KV cache, as chat messages or as token ids.

Messages are validated as chat completions validates them, and `render.render_pin` renders them as the
head of a chat prompt, so a pin of the system message and tools is a token prefix of every later chat that
opens with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from swarmkv.api.chat_request import Message, parse_messages, parse_tools
from swarmkv.api.errors import bad_request, get_field
from swarmkv.api.limits import check_array_counts


@dataclass(frozen=True)
class PinRequest:
    """A validated pin body: exactly one of `messages` (with optional `tools`) and `prompt_token_ids`."""

    model: str | None
    messages: list[Message] | None
    tools: list[dict[str, Any]] | None
    prompt_token_ids: list[int] | None
    ttl_s: float | None  # None: held until unpinned (or the engine's cap trims it)
    cache_salt: str | None


# The top-level arrays a pin body's parser counts before it reads anything.
PIN_ARRAYS = ("tools",)


def parse_pin_request(body: dict[str, Any]) -> PinRequest:
    """Validate a pin body; every mistake is a 400 naming the field."""
    check_array_counts(body, PIN_ARRAYS)
    has_messages, has_ids = body.get("messages") is not None, body.get("prompt_token_ids") is not None
    if has_messages == has_ids:
        raise bad_request(
            "a pin needs exactly one of 'messages' (chat messages, optionally with 'tools') "
            "and 'prompt_token_ids' (an array of token ids)",
            param="messages",
        )
    messages = parse_messages(body["messages"], allow_empty=True) if has_messages else None
    tools = parse_tools(body.get("tools"))
    if tools is not None and not has_messages:
        raise bad_request("'tools' go with 'messages'; token ids already hold them", param="tools")
    ids = body.get("prompt_token_ids")
    if has_ids and (
        not isinstance(ids, list)
        or not ids
        or any(not isinstance(t, int) or isinstance(t, bool) for t in ids)
    ):
        raise bad_request(
            "'prompt_token_ids' must be a non-empty array of integers", param="prompt_token_ids"
        )
    cache_salt = get_field(body, "cache_salt", str, "a string")
    if cache_salt == "":
        raise bad_request("'cache_salt' must be a non-empty string", param="cache_salt")
    return PinRequest(
        model=get_field(body, "model", str, "a string"),
        messages=messages,
        tools=tools,
        prompt_token_ids=ids if has_ids else None,
        ttl_s=_ttl_s(body),
        cache_salt=cache_salt,
    )


def _ttl_s(body: dict[str, Any]) -> float | None:
    value = get_field(body, "ttl_s", (int, float), "a number of seconds")
    if value is None:
        return None
    try:
        ttl_s = float(value)
    except OverflowError:  # an integer too large for a float
        ttl_s = math.inf
    if not math.isfinite(ttl_s) or ttl_s <= 0:
        # json.loads reads NaN and Infinity literals, so a non-finite number can arrive.
        raise bad_request(f"'ttl_s' must be a positive, finite number of seconds, got {value}", param="ttl_s")
    return ttl_s
