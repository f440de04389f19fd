"""The Anthropic /v1/messages body -> the chat completions body it means, plus its cache breakpoints.

Messages is a thin layer: the body is rewritten into OpenAI's form (`messages_blocks.py`: tool_use blocks as
assistant `tool_calls`, tool_result blocks as `tool` messages), which the chat template already renders, and
then validated by the same parser chat completions uses.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, replace
from typing import Any

from swarmkv.api.chat_request import ChatRequest, Message, parse_chat_request, parse_messages, parse_tools
from swarmkv.api.errors import APIError, bad_request, get_field
from swarmkv.api.layout import Layout, tools_lead
from swarmkv.api.limits import SchemaBudget, check_array_counts
from swarmkv.api.messages_blocks import MessagesBuilder
from swarmkv.api.pin_request import PinRequest
from swarmkv.api.session_id import MAX_SESSION_ID_CHARS, check_session_id
from swarmkv.api.structured_request import response_format_body
from swarmkv.tokenizer import Tokenizer

MAX_BREAKPOINTS = 4  # Anthropic's limit on cache_control blocks per request
THREAD_UNSUPPORTED = "thread_unsupported_request"


@dataclass(frozen=True)
class Breakpoint:
    """A cache_control mark: the conversation up to and including its block, to pin for `ttl_s`."""

    # Normalised. A mark on a tool has the head every request with these tools opens with in the template's
    # order: the system turn (templates render the tools inside it), or none for a chat opening with a user
    # turn; `MessagesRequest.pin_request` makes it the tools alone where the prompt puts them first.
    messages: list[Message]
    ttl_s: float
    on_tools: bool = False


@dataclass(frozen=True)
class MessagesRequest:
    """A validated /v1/messages (or count_tokens) body."""

    chat: ChatRequest
    breakpoints: list[Breakpoint]
    user_id: (
        str | None
    )  # metadata.user_id (Claude Code's: the session_id in its JSON): the session, for retention
    chat_body: dict[str, Any]  # the equivalent chat completions body, which `swarmkv lint` reads from the log
    template_kwargs: dict[str, Any]  # the chat template's switches: `thinking` as `enable_thinking`

    def pin_request(self, mark: Breakpoint, tokenizer: Tokenizer, layout: Layout) -> PinRequest:
        """The pin of a cache_control mark, for `render_pin` under the prompt's `layout`. A mark on a tool pins
        the tools alone (Anthropic caches tools, then system, then messages) where the prompt opens with them
        (`tools_lead`: tools-first, with a tool block the template's own), else the system turn they are in."""
        tools = self.chat.prompt_tools
        messages = mark.messages
        if mark.on_tools and layout == "tools-first" and tools_lead(tokenizer, messages, tools):
            messages = []  # `render_pin` renders no messages under tools-first as the tool block's head
        return PinRequest(None, messages, tools, None, mark.ttl_s, self.chat.options.cache_salt)


# The top-level arrays a Messages body's parser counts before it reads anything.
MESSAGES_ARRAYS = ("tools", "stop_sequences")


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
    _refuse_unsupported(body)
    check_array_counts(body, MESSAGES_ARRAYS)  # before any tool or stop is read
    _check_num_marks(body)  # before any block is read: each mark snapshots the conversation
    template_kwargs = _thinking(body.get("thinking"))
    metadata = get_field(body, "metadata", dict, "an object", {})
    user_id = _session_of(metadata.get("user_id"))
    builder = MessagesBuilder()
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
        "chat_template_kwargs": template_kwargs or None,
        "response_format": _output_format(body),
    }
    chat_body = {key: value for key, value in chat_body.items() if value is not None}
    chat = parse_chat_request(chat_body, tools)  # the tools `_tools` validated
    if builder.loaded:  # deferred tools a tool search loaded: callable, and not in the tool block
        loaded = parse_tools([builder.deferred[name] for name in builder.loaded])
        chat = replace(chat, loaded_tools=loaded)
    # A mark on a tool (the tools come first, so nothing before it) pins the head every request with these
    # tools opens with (see `Breakpoint`).
    head = chat.messages[:1] if chat.messages[0]["role"] == "system" else []
    breakpoints = [
        Breakpoint(parse_messages(msgs, allow_empty=True) or head, ttl_s, on_tools=not msgs)
        for msgs, ttl_s in builder.marks
    ]
    return MessagesRequest(chat, breakpoints, user_id, chat_body, template_kwargs)


def _output_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """`output_config.format` (or the structured-outputs beta's `output_format`) as chat's response_format."""
    output_config = get_field(body, "output_config", dict, "an object", {})
    if output_config.get("format") is not None:
        return response_format_body(output_config["format"], "output_config.format")
    return response_format_body(body.get("output_format"), "output_format")


def _check_num_marks(body: dict[str, Any]) -> None:
    """A 400 when more than MAX_BREAKPOINTS blocks carry cache_control: a count of the raw body's blocks where
    the builder looks for marks (tools, system blocks, message content blocks), nothing validated yet."""

    def blocks(value: Any) -> list[Any]:
        return value if isinstance(value, list) else []

    messages = blocks(body.get("messages"))
    contents = [m.get("content") for m in messages if isinstance(m, dict)]
    every_block = [*blocks(body.get("tools")), *blocks(body.get("system"))]
    every_block += [block for content in contents for block in blocks(content)]
    num_marks = sum(
        1 for block in every_block if isinstance(block, dict) and block.get("cache_control") is not None
    )
    if num_marks > MAX_BREAKPOINTS:
        raise bad_request(
            f"at most {MAX_BREAKPOINTS} blocks may have cache_control, got {num_marks}", param="cache_control"
        )


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Fields a local text model cannot honour and whose omission would change the answer: a 400 naming them.

    What only tunes Anthropic's service is accepted and ignored: `context_management` (its edits clear past
    thinking, which the chat template drops anyway), `output_config.effort`, `service_tier`, `container`,
    `mcp_servers` and the betas (`anthropic-beta`, `?beta=true`). Tools' `defer_loading` is honoured as
    Anthropic's API does it (`_tools`).
    """
    get_field(body, "output_config", dict, "an object", {})


def _thinking(thinking: Any) -> dict[str, Any]:
    """`thinking` as the chat template's `enable_thinking` (templates without the switch never read it).

    Absent, the template's default stands: Anthropic's default is no thinking, but a template's default is
    what its model was tuned to answer with.
    """
    if thinking is None:
        return {}
    kind = thinking.get("type") if isinstance(thinking, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise bad_request(
            "thinking.type: Input should be 'enabled', 'adaptive' or 'disabled'", param="thinking.type"
        )
    return {"enable_thinking": kind != "disabled"}


def _session_of(user_id: Any) -> str | None:
    """metadata.user_id as a session id: the `session_id` of Claude Code's JSON user_id, else the id itself;
    one too long for a session id is replaced by its digest."""
    session_id = json_session_id(user_id)
    if session_id is not None:
        user_id = session_id
    if isinstance(user_id, str) and len(user_id) > MAX_SESSION_ID_CHARS:
        # Clients such as Claude Code send long composite ids; refusing them would refuse the client.
        return f"user-{hashlib.sha256(user_id.encode()).hexdigest()[:32]}"
    return check_session_id(user_id, "'metadata.user_id'")


def json_session_id(user_id: Any) -> str | None:
    """The non-empty `session_id` string of a user_id that is a JSON object (Claude Code's), else None."""
    if not isinstance(user_id, str) or not user_id.startswith("{"):
        return None
    try:
        fields = json.loads(user_id)
    except (ValueError, RecursionError):  # the decoder recurses once per nesting level
        return None
    session_id = fields.get("session_id") if isinstance(fields, dict) else None
    return session_id if isinstance(session_id, str) and session_id else None


def _tools(tools: list[Any] | None, builder: MessagesBuilder) -> list[dict[str, Any]] | None:
    """Anthropic tools as OpenAI function tools; a cache mark on a tool pins the tools alone."""
    if tools is None:
        return None
    budget = SchemaBudget()  # deferred tools' schemas and the offered ones' (`parse_tools`) spend from one
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
        if tool.get("strict") is True:  # its input must follow input_schema exactly: unenforceable is a 400
            function["strict"] = True
        if tool.get("defer_loading") is True:
            # As Anthropic's API defers it: out of the prompt's tool block (so loading one never changes the
            # cached head), its definition where a tool search's `tool_reference` names it.
            budget.check(tool["input_schema"], where)
            builder.deferred[tool["name"]] = {"type": "function", "function": function}
            continue
        out.append({"type": "function", "function": function})
        builder.mark(where, tool)
    return parse_tools(out, budget) if out or not builder.deferred else None


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
