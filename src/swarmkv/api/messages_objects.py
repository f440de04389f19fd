"""The JSON objects the Anthropic Messages API answers with: messages, stream events, usage and errors.

A thinking model's reasoning (`api/reasoning.py`) is a `thinking` block before the reply's text and calls,
whole or streamed as Anthropic streams one (`thinking_delta`s, then a `signature_delta`), with a signature.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from swarmkv.api.errors import APIError
from swarmkv.api.outputs import StepOutput
from swarmkv.api.tool_parser import ParsedDelta, ToolCall, in_writing_order

# Anthropic's error types by HTTP status; an unavailable engine is its 529 "overloaded".
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}


def anthropic_error(error: APIError) -> tuple[int, dict[str, Any]]:
    """The status and body of `error` in Anthropic's shape."""
    status = 529 if error.status == 503 else error.status
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body: dict[str, Any] = {"type": kind, "message": error.message}
    if error.details is not None:
        body["details"] = error.details
    return status, {"type": "error", "error": body}


def anthropic_event(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event of Anthropic's stream: a named event carrying a JSON object."""
    payload = json.dumps({"type": kind, **data}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {payload}\n\n"


def stop_reason(out: StepOutput | None, num_calls: int) -> str:
    """Anthropic's stop_reason for a reply's last output and its number of tool calls."""
    if num_calls:
        return "tool_use"
    if out is not None and out.finish_reason == "length":
        return "max_tokens"
    if out is not None and out.stop_string is not None:
        return "stop_sequence"
    return "end_turn"


def matched_stop(out: StepOutput | None, reason: str) -> str | None:
    """The stop sequence that ended the reply, when `reason` says one did."""
    return out.stop_string if out is not None and reason == "stop_sequence" else None


@dataclass(frozen=True)
class CacheTokens:
    """A request's prompt tokens split as Anthropic counts them; the three add up to the prompt's length."""

    input_tokens: int  # computed for this request, not under a cache_control mark
    cache_read_input_tokens: int  # served from the prefix cache, not computed for this request
    cache_creation_input_tokens: int  # computed for this request by its marks' pins, and pinned

    @staticmethod
    def of(out: StepOutput | None, num_created_tokens: int) -> CacheTokens:
        """Split `out`'s prompt. The request's pins ran first and computed `num_created_tokens` of its prefix
        (the rest of what they hold they found cached), so those are among its hits but were not read."""
        if out is None:
            return CacheTokens(0, 0, 0)
        created = min(num_created_tokens, out.num_cached_tokens)
        return CacheTokens(
            out.num_prompt_tokens - out.num_cached_tokens, out.num_cached_tokens - created, created
        )

    def usage(self, num_output_tokens: int) -> dict[str, int]:
        """Anthropic's usage object."""
        return {
            "input_tokens": self.input_tokens,
            "output_tokens": num_output_tokens,
            "cache_read_input_tokens": self.cache_read_input_tokens,
            "cache_creation_input_tokens": self.cache_creation_input_tokens,
        }


def thinking_signature(thinking: str) -> str:
    """A thinking block's `signature`: a digest of its text (base64, as Anthropic's opaque ones are).

    Anthropic signs its thinking so that a client sends the block back unchanged; clients (Claude Code) keep
    and return the field, so it is never empty. This server does not check it: a block sent back is the
    turn's reasoning, whatever its signature.
    """
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def thinking_block(thinking: str) -> dict[str, Any]:
    """A reply's reasoning as a whole thinking content block."""
    return {"type": "thinking", "thinking": thinking, "signature": thinking_signature(thinking)}


def tool_input(arguments: str) -> dict[str, Any]:
    """A parsed call's JSON arguments as a tool_use block's `input` object."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use_block(call: ToolCall) -> dict[str, Any]:
    """A parsed tool call as a tool_use content block."""
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)}


def message_json(
    msg_id: str,
    model: str,
    content: list[dict[str, Any]],
    reason: str | None,
    usage: dict[str, int],
    stop_sequence: str | None = None,
) -> dict[str, Any]:
    """The message object (empty content and no stop_reason at a stream's start)."""
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop_sequence,
        "usage": usage,
    }


def reply_content(parsed: ParsedDelta) -> list[dict[str, Any]]:
    """A whole reply's content blocks: its thinking, its text, then its tool_use blocks."""
    content = [thinking_block(parsed.reasoning)] if parsed.reasoning else []
    content += [{"type": "text", "text": parsed.content}] if parsed.content else []
    return content + [tool_use_block(call) for call in parsed.tool_calls]


class ContentBlocks:
    """A streamed reply's content blocks as Anthropic's events: a thinking block, text blocks, and tool_use
    blocks whose input JSON arrives in pieces. A call open when a delta arrives ends before that delta's text
    begins; the reasoning comes before all of a reply's text and calls, so they end the thinking block."""

    def __init__(self) -> None:
        self.index = 0  # the open block's, or the next one's
        self.text_open = False
        self.call_open = False
        self.thinking: str | None = None  # the open thinking block's text so far, None when none is open
        self.num_calls = 0

    def add(self, parsed: ParsedDelta) -> Iterator[str]:
        """The events for one parsed delta."""
        yield from self._think(parsed.reasoning)
        if parsed.content or parsed.pieces or parsed.tool_calls:
            yield from self._close_thinking()
        yield from in_writing_order(parsed, self.call_open, self._text, self._calls)

    def close(self) -> Iterator[str]:
        """End the reply's open thinking or text block."""
        yield from self._close_thinking()
        yield from self.close_text()

    def _think(self, reasoning: str) -> Iterator[str]:
        if not reasoning:
            return
        if self.thinking is None:
            opening = {"type": "thinking", "thinking": "", "signature": ""}
            yield anthropic_event("content_block_start", {"index": self.index, "content_block": opening})
            self.thinking = ""
        self.thinking += reasoning
        delta = {"type": "thinking_delta", "thinking": reasoning}
        yield anthropic_event("content_block_delta", {"index": self.index, "delta": delta})

    def _close_thinking(self) -> Iterator[str]:
        if self.thinking is None:
            return
        delta = {"type": "signature_delta", "signature": thinking_signature(self.thinking)}
        yield anthropic_event("content_block_delta", {"index": self.index, "delta": delta})
        yield anthropic_event("content_block_stop", {"index": self.index})
        self.index, self.thinking = self.index + 1, None

    def close_text(self) -> Iterator[str]:
        """End an open text block."""
        if self.text_open:
            yield anthropic_event("content_block_stop", {"index": self.index})
            self.index, self.text_open = self.index + 1, False

    def _text(self, content: str) -> Iterator[str]:
        if not content:
            return
        if not self.text_open:
            opening = {"type": "text", "text": ""}
            yield anthropic_event("content_block_start", {"index": self.index, "content_block": opening})
            self.text_open = True
        delta = {"type": "text_delta", "text": content}
        yield anthropic_event("content_block_delta", {"index": self.index, "delta": delta})

    def _calls(self, parsed: ParsedDelta) -> Iterator[str]:
        for piece in parsed.pieces:
            if piece.name is not None:
                yield from self.close_text()
                block = {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
                yield anthropic_event("content_block_start", {"index": self.index, "content_block": block})
                self.call_open = True
            if piece.arguments:
                delta = {"type": "input_json_delta", "partial_json": piece.arguments}
                yield anthropic_event("content_block_delta", {"index": self.index, "delta": delta})
        for _ in parsed.tool_calls:
            yield anthropic_event("content_block_stop", {"index": self.index})
            self.index, self.call_open = self.index + 1, False
            self.num_calls += 1
