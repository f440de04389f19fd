"""The JSON objects /v1/chat/completions and /v1/completions answer with: completions, chunks, usage, events."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from swarmkv.api.outputs import StepOutput
from swarmkv.api.tool_call_stream import CallPiece
from swarmkv.api.tool_parser import ToolCall


def usage(out: StepOutput | None) -> dict[str, Any]:
    """OpenAI's usage object as of a reply's last output; `cached_tokens` counts prompt tokens the prefix
    cache served."""
    num_prompt, num_completion = (out.num_prompt_tokens, out.num_output_tokens) if out else (0, 0)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens if out else 0},
    }


def finish_reason(out: StepOutput | None, num_calls: int) -> str | None:
    """OpenAI's finish_reason of a reply's last output: "tool_calls" when a reply that stopped made calls."""
    reason = out.finish_reason if out is not None else None
    return "tool_calls" if num_calls and reason == "stop" else reason


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event carrying a JSON object (or the literal `[DONE]`)."""
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {payload}\n\n"


@dataclass(frozen=True)
class Envelope:
    """What every object of one response repeats: id, creation time and model name."""

    id: str
    created: int
    model: str

    def chat_completion(
        self,
        content: str | None,
        tool_calls: list[ToolCall],
        finish_reason: str | None,
        usage: dict[str, Any],
        reasoning: str = "",
    ) -> dict[str, Any]:
        """A whole chat.completion; a thinking model's reasoning, when split out, as `reasoning_content`."""
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        if tool_calls:
            message["tool_calls"] = [call.to_openai() for call in tool_calls]
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("chat.completion"), "choices": [choice], "usage": usage}

    def chat_chunk(
        self, delta: dict[str, Any], finish_reason: str | None = None, with_usage_field: bool = False
    ) -> dict[str, Any]:
        """A chat.completion.chunk with one choice; `usage: null` is present when the final chunk will carry it."""
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._head("chat.completion.chunk"), "choices": [choice]}
        return {**chunk, "usage": None} if with_usage_field else chunk

    def completion(self, text: str, finish_reason: str | None, usage: dict[str, Any]) -> dict[str, Any]:
        """A whole text_completion."""
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage}

    def completion_chunk(
        self, text: str, finish_reason: str | None = None, with_usage_field: bool = False
    ) -> dict[str, Any]:
        """A streamed text_completion piece."""
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._head("text_completion"), "choices": [choice]}
        return {**chunk, "usage": None} if with_usage_field else chunk

    def usage_chunk(self, obj: str, usage: dict[str, Any]) -> dict[str, Any]:
        """The final streamed object under `stream_options.include_usage`: no choices, only usage."""
        return {**self._head(obj), "choices": [], "usage": usage}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def tool_call_delta(piece: CallPiece) -> dict[str, Any]:
    """A streamed piece of a tool call: the first carries its id and name, the rest only argument text."""
    if piece.name is None:
        return {"tool_calls": [{"index": piece.index, "function": {"arguments": piece.arguments}}]}
    opening = ToolCall(piece.id, piece.name, piece.arguments).to_openai()
    return {"tool_calls": [{"index": piece.index, **opening}]}
