"""The JSON objects the OpenAI Responses API answers with: responses, output items, usage and stream events.

A thinking model's reasoning (`api/reasoning.py`) is a `reasoning` item before the reply's message and calls:
its text as `reasoning_text` content, as the Responses API returns an open model's reasoning, and also as the
item's one `summary_text` when the request asks for a summary (`reasoning.summary`): this server has no
summarizer, and clients such as Codex CLI show the summary, not the content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from swarmkv.api.outputs import StepOutput
from swarmkv.api.tool_parser import ToolCall


def new_id(prefix: str) -> str:
    """A fresh object id such as `resp_...`, `msg_...` or `fc_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """An assistant output message holding one output_text part."""
    content = [text_part(text)] if status == "completed" else []
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def text_part(text: str) -> dict[str, Any]:
    """An output_text content part."""
    return {"type": "output_text", "text": text, "annotations": []}


def function_call_item(
    item_id: str, call: ToolCall, status: str = "completed", namespace: str | None = None
) -> dict[str, Any]:
    """A parsed tool call as a function_call output item (empty arguments while it streams); a function
    offered from a `namespace` tool carries it in `namespace`, beside its own name, as the Responses API
    returns it (Codex CLI reads the pair)."""
    arguments = call.arguments if status == "completed" else ""
    item = {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item


def reasoning_item(item_id: str, text: str, summary: bool, status: str = "completed") -> dict[str, Any]:
    """A reply's reasoning as a reasoning output item (no text yet while it streams); `summary`: the text is
    also the item's summary."""
    done = status == "completed"
    return {
        "type": "reasoning",
        "id": item_id,
        "summary": [summary_part(text)] if done and summary else [],
        "content": [reasoning_part(text)] if done else [],
        "encrypted_content": None,  # nothing is encrypted: the text is in `content`, which clients send back
        "status": status,
    }


def summary_part(text: str) -> dict[str, Any]:
    """A reasoning item's summary_text part."""
    return {"type": "summary_text", "text": text}


def reasoning_part(text: str) -> dict[str, Any]:
    """A reasoning item's reasoning_text content part."""
    return {"type": "reasoning_text", "text": text}


def usage(out: StepOutput | None, num_reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses usage object; `cached_tokens` counts prompt tokens the prefix cache served,
    `reasoning_tokens` the output tokens of the reply's reasoning (among `output_tokens`)."""
    num_input = out.num_prompt_tokens if out else 0
    num_output = out.num_output_tokens if out else 0
    return {
        "input_tokens": num_input,
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens if out else 0},
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": min(num_reasoning_tokens, num_output)},
        "total_tokens": num_input + num_output,
    }


def is_incomplete(out: StepOutput | None, num_calls: int) -> bool:
    """Whether the reply stopped at max_output_tokens rather than finishing (a whole call counts as finished)."""
    return num_calls == 0 and out is not None and out.finish_reason == "length"


@dataclass(frozen=True)
class ResponseHead:
    """What every snapshot of one response repeats: ids, time, model and the echoed request fields."""

    id: str
    created_at: int
    model: str
    previous_response_id: str | None
    echo: dict[str, Any]

    def body(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None,
        incomplete: bool = False,
    ) -> dict[str, Any]:
        """The response object at `status` ("in_progress", "completed" or "incomplete")."""
        details = {"reason": "max_output_tokens"} if incomplete else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "model": self.model,
            "output": output,
            "incomplete_details": details,
            "previous_response_id": self.previous_response_id,
            "error": None,
            "usage": usage,
            **self.echo,
        }


@dataclass
class EventWriter:
    """Numbers a stream's events: each `event: <type>` line and JSON payload carries the next sequence_number."""

    sequence_number: int = 0

    def __call__(self, kind: str, data: dict[str, Any]) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **data}
        self.sequence_number += 1
        text = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {text}\n\n"
