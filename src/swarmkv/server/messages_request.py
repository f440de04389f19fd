"""The Anthropic /v1/messages body -> the chat completions body it means, plus its cache breakpoints.

Messages is a thin layer: the body is rewritten into OpenAI's form (tool_use blocks as assistant
`tool_calls`, tool_result blocks as `tool` messages), which the chat template already renders, and then
validated by the same parser chat completions uses.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from swarmkv.server.chat_request import ChatRequest, Message, parse_chat_request, parse_messages, parse_tools
from swarmkv.server.protocol import (
    MAX_SESSION_ID_CHARS,
    APIError,
    bad_request,
    check_session_id,
    get_field,
    type_name,
)

MAX_BREAKPOINTS = 4  # Anthropic's limit on cache_control blocks per request
TTL_S = {"5m": 300.0, "1h": 3600.0}
THREAD_UNSUPPORTED = "thread_unsupported_request"


@dataclass(frozen=True)
class Breakpoint:
    """A cache_control mark: the conversation up to and including its block, to pin for `ttl_s`."""

    messages: list[Message]  # normalised; empty when the mark is on a tool (the tools alone)
    ttl_s: float


@dataclass(frozen=True)
class MessagesRequest:
    """A validated /v1/messages (or count_tokens) body."""

    chat: ChatRequest
    breakpoints: list[Breakpoint]
    user_id: str | None  # metadata.user_id: the session, for retention
    chat_body: dict[str, Any]  # the equivalent chat completions body, which `swarmkv lint` reads from the log


def parse_messages_request(body: dict[str, Any], needs_max_tokens: bool = True) -> MessagesRequest:
    """Validate a Messages body; every mistake is a 400 naming the field."""
    max_tokens = get_field(body, "max_tokens", int, "an integer")
    if needs_max_tokens and max_tokens is None:
        raise bad_request("'max_tokens' is required", param="max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    if body.get("thread") is not None:
        # A continued thread would send only its new messages: answering those alone would lose the history.
        # This error code tells Anthropic's clients to go on without a thread, sending the whole history.
        raise APIError(
            400,
            "message threads are not supported: send the whole conversation",
            param="thread",
            code=THREAD_UNSUPPORTED,
            details={"error_code": THREAD_UNSUPPORTED, "unsupported": ["thread"]},
        )
    metadata = get_field(body, "metadata", dict, "an object", {})
    user_id = _session_of(metadata.get("user_id"))
    builder = _Builder()
    tools = _tools(get_field(body, "tools", list, "an array"), builder)
    builder.system(body.get("system"))
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise bad_request("'messages' must be a non-empty array of message objects", param="messages")
    for i, m in enumerate(raw_messages):
        builder.message(i, m)
    stop = get_field(body, "stop_sequences", list, "an array of strings")
    chat_body: dict[str, Any] = {
        "model": body.get("model"),
        "messages": builder.done(),
        "tools": tools,
        "tool_choice": _tool_choice(body.get("tool_choice")),
        "stream": body.get("stream"),
        "max_tokens": max_tokens,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "top_k": body.get("top_k"),
        "stop": stop or None,
    }
    chat_body = {key: value for key, value in chat_body.items() if value is not None}
    chat = parse_chat_request(chat_body)
    if len(builder.marks) > MAX_BREAKPOINTS:
        raise bad_request(
            f"at most {MAX_BREAKPOINTS} blocks may have cache_control, got {len(builder.marks)}",
            param="cache_control",
        )
    # A mark on a tool pins the head every request with these tools opens with: the system turn, when there is
    # one (templates render the tools inside it), else the head shared by all chats opening with a user turn.
    head = chat.messages[:1] if chat.messages[0]["role"] == "system" else []
    breakpoints = [
        Breakpoint(parse_messages(msgs, allow_empty=True) or head, ttl_s) for msgs, ttl_s in builder.marks
    ]
    return MessagesRequest(chat, breakpoints, user_id, chat_body)


def _session_of(user_id: Any) -> str | None:
    """metadata.user_id as a session id; one too long for a session id is replaced by its digest."""
    if isinstance(user_id, str) and len(user_id) > MAX_SESSION_ID_CHARS:
        # Clients such as Claude Code send long composite ids; refusing them would refuse the client.
        return f"user-{hashlib.sha256(user_id.encode()).hexdigest()[:32]}"
    return check_session_id(user_id, "'metadata.user_id'")


def _ttl_s(where: str, block: dict[str, Any]) -> float | None:
    """The block's cache_control TTL in seconds; None when it has no cache_control."""
    control = block.get("cache_control")
    if control is None:
        return None
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise bad_request(
            f"{where}.cache_control must be {{'type': 'ephemeral'}}", param=f"{where}.cache_control"
        )
    ttl = control.get("ttl", "5m")
    if ttl not in TTL_S:
        raise bad_request(
            f"{where}.cache_control.ttl must be '5m' or '1h', got {ttl!r}", param=f"{where}.cache_control"
        )
    return TTL_S[ttl]


class _Builder:
    """Builds the OpenAI-form messages block by block, snapshotting the conversation at each cache mark."""

    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.pending: Message | None = None  # the message the current blocks go into
        self.marks: list[tuple[list[Message], float]] = []

    def done(self) -> list[Message]:
        """Every message, the pending one included."""
        self._flush()
        return self.messages

    def mark(self, where: str, block: dict[str, Any]) -> None:
        """Snapshot the conversation so far if `block` carries cache_control."""
        ttl_s = _ttl_s(where, block)
        if ttl_s is not None:
            pending = [copy.deepcopy(self.pending)] if self.pending is not None else []
            self.marks.append((copy.deepcopy(self.messages) + pending, ttl_s))

    def system(self, system: Any) -> None:
        if system is None:
            return
        if isinstance(system, str):
            self.messages.append({"role": "system", "content": system})
            return
        if not isinstance(system, list):
            raise bad_request(
                f"'system' must be a string or an array of text blocks, got {type_name(system)}",
                param="system",
            )
        self.pending = {"role": "system", "content": ""}
        for j, block in enumerate(system):
            where = f"system[{j}]"
            self._text(where, _block(where, block, ("text",)))
            self.mark(where, block)
        self._flush()

    def message(self, i: int, m: Any) -> None:
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"{where} must be an object with role 'user' or 'assistant'", param=where)
        content = m.get("content")
        if isinstance(content, str):
            self._flush()
            self.messages.append({"role": role, "content": content})
            return
        if not isinstance(content, list):
            raise bad_request(
                f"{where}.content must be a string or an array of blocks", param=f"{where}.content"
            )
        allowed = ("text", "tool_result") if role == "user" else ("text", "tool_use")
        self._flush()
        for j, raw in enumerate(content):
            bwhere = f"{where}.content[{j}]"
            block = _block(bwhere, raw, allowed)
            if block["type"] == "tool_result":
                self._flush()
                self.messages.append(_tool_result(bwhere, block))
            else:
                self._open(role)
                if block["type"] == "text":
                    self._text(bwhere, block)
                else:
                    self._tool_use(bwhere, block)
            self.mark(bwhere, block)
        self._flush()

    def _open(self, role: str) -> None:
        if self.pending is None or self.pending["role"] != role:
            self._flush()
            self.pending = {"role": role, "content": ""}

    def _flush(self) -> None:
        if self.pending is not None:
            if self.pending["content"] or self.pending.get("tool_calls"):
                self.messages.append(self.pending)
            self.pending = None

    def _text(self, where: str, block: dict[str, Any]) -> None:
        assert self.pending is not None
        text = block.get("text")
        if not isinstance(text, str):
            raise bad_request(f"{where}.text must be a string", param=where)
        # Blocks of one turn join with newlines, as chat completions joins text parts.
        self.pending["content"] = f"{self.pending['content']}\n{text}" if self.pending["content"] else text

    def _tool_use(self, where: str, block: dict[str, Any]) -> None:
        assert self.pending is not None
        if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
            raise bad_request(f"{where} must be a tool_use block with a string 'id' and 'name'", param=where)
        arguments = block.get("input", {})
        if not isinstance(arguments, dict):
            raise bad_request(f"{where}.input must be an object", param=where)
        call = {
            "id": block["id"],
            "type": "function",
            "function": {"name": block["name"], "arguments": arguments},
        }
        self.pending.setdefault("tool_calls", []).append(call)


def _block(where: str, block: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    """A content block of one of the `allowed` types, or a 400 naming what it is."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in ("image", "document"):
        raise bad_request(
            f"{where}: {kind} blocks are not supported: swarmkv runs the text model only", param=where
        )
    if not isinstance(block, dict) or kind not in allowed:
        raise bad_request(
            f"{where}: block type {kind!r} is not supported here (allowed: {', '.join(allowed)})", param=where
        )
    return block


def _tool_result(where: str, block: dict[str, Any]) -> Message:
    """A tool_result block as the OpenAI `tool` message the chat template renders."""
    if not isinstance(block.get("tool_use_id"), str):
        raise bad_request(f"{where}.tool_use_id must be a string", param=where)
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(
            _block(f"{where}.content[{k}]", b, ("text",)).get("text", "") for k, b in enumerate(content)
        )
    if not isinstance(content, str):
        raise bad_request(f"{where}.content must be a string or an array of text blocks", param=where)
    if block.get("is_error"):
        content = f"Error: {content}"  # the template has no error flag, so the model reads it in the text
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def _tools(tools: list[Any] | None, builder: _Builder) -> list[dict[str, Any]] | None:
    """Anthropic tools as OpenAI function tools; a cache mark on a tool pins the tools alone."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if (
            not isinstance(tool, dict)
            or tool.get("type", "custom") != "custom"
            or not isinstance(tool.get("name"), str)
            or not tool["name"]
            or not isinstance(tool.get("input_schema"), dict)
        ):
            raise bad_request(
                f"{where} must be {{'name': ..., 'description': ..., 'input_schema': {{...}}}} "
                "(Anthropic's server tools are not supported)",
                param=where,
            )
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
        builder.mark(where, tool)
    return parse_tools(out)


def _tool_choice(choice: Any) -> Any:
    """Anthropic's tool_choice as OpenAI's."""
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        "tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
        param="tool_choice",
    )


def tool_input(arguments: str) -> dict[str, Any]:
    """A parsed call's JSON arguments as a tool_use block's `input` object."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
