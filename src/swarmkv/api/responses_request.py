"""The OpenAI /v1/responses body -> the chat completions body it means, plus the fields a response echoes.

Responses is a thin layer like Messages: input items become OpenAI chat messages (function_call items as
assistant `tool_calls`, function_call_output items as `tool` messages, reasoning items as the next assistant
turn's `reasoning_content`), a stored chain's items come first, and the result is validated by the same
parser chat completions uses. `chat_template_kwargs` and `enable_thinking` pass through as on chat
completions, and `reasoning.effort: "none"` switches a thinking template's thinking off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarmkv.api.chat_request import ChatRequest, Message, parse_chat_request
from swarmkv.api.errors import bad_request, get_field, type_name
from swarmkv.api.limits import check_array_counts, check_num_tools
from swarmkv.api.reasoning import THINKING_SWITCH
from swarmkv.api.structured_request import response_format_body
from swarmkv.choices import HostedToolsPolicy

Item = dict[str, Any]

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
_REASONING_PARTS = ("reasoning_text", "text")  # a reasoning item's content parts
_SUMMARY_STYLES = ("auto", "concise", "detailed")  # `reasoning.summary` values that ask for a summary
_MEDIA_PARTS = ("input_image", "input_file", "input_audio", "image_url")


@dataclass(frozen=True)
class ResponsesRequest:
    """A validated /v1/responses (or input_tokens) body."""

    chat: ChatRequest
    chat_body: dict[str, Any]  # the equivalent chat completions body, which `swarmkv lint` reads from the log
    input_items: list[Item]  # this request's input, normalised; stored after the chain's earlier items
    echo: dict[str, Any]  # request fields the response object repeats
    store: bool
    previous_response_id: str | None
    # Function name -> its namespace, for the functions offered from `namespace` tools: their calls come
    # back with the namespace, as the Responses API returns them (`function_call.namespace`).
    namespaces: dict[str, str]
    # The hosted tools (web_search, file_search, ...) left out of the prompt, as "tools[i]: type".
    dropped_tools: list[str]
    # `reasoning.summary` asks for one: the reply's reasoning is also its reasoning item's summary.
    reasoning_summary: bool = False


def previous_response_id(body: dict[str, Any]) -> str | None:
    """The chain this request continues, if any."""
    value = get_field(body, "previous_response_id", str, "a string")
    if value == "":
        raise bad_request("'previous_response_id' must not be empty", param="previous_response_id")
    return value


# The top-level arrays a Responses body's parser counts before it reads anything.
RESPONSES_ARRAYS = ("tools",)


def parse_responses_request(
    body: dict[str, Any], history: list[Item], hosted_tools: HostedToolsPolicy = "drop"
) -> ResponsesRequest:
    """Validate a Responses body continuing the chain `history` (empty for a new one); mistakes are 400s.

    Hosted tools are dropped from the prompt (and listed) or refused, as `hosted_tools` says.
    """
    check_array_counts(body, RESPONSES_ARRAYS)
    max_output_tokens = get_field(body, "max_output_tokens", int, "an integer")
    if max_output_tokens is not None and max_output_tokens < 1:
        raise bad_request(
            f"max_output_tokens must be at least 1, got {max_output_tokens}", param="max_output_tokens"
        )
    _refuse_unsupported(body)
    instructions = get_field(body, "instructions", str, "a string")
    metadata = get_field(body, "metadata", dict, "an object")
    store = get_field(body, "store", bool, "a boolean", True)
    include = get_field(body, "include", list, "an array", [])
    if any(not isinstance(name, str) for name in include):
        raise bad_request("'include' must be an array of strings", param="include")
    get_field(body, "client_metadata", dict, "an object")
    offered = _tools(get_field(body, "tools", list, "an array"), hosted_tools)
    reasoning = get_field(body, "reasoning", dict, "an object", {})
    summary = reasoning.get("summary", reasoning.get("generate_summary"))  # the second is its older name
    if summary is not None and summary not in _SUMMARY_STYLES:
        raise bad_request(
            f"reasoning.summary must be one of {', '.join(_SUMMARY_STYLES)}, got {summary!r}",
            param="reasoning.summary",
        )
    items = _input_items(body.get("input"))
    # Instructions are not inherited along a chain (OpenAI's semantics): each request's go first, unstored.
    head: list[Message] = [{"role": "system", "content": instructions}] if instructions else []
    chat_body: dict[str, Any] = {
        "model": body.get("model"),
        "messages": head + items_to_messages(history + items),
        "tools": offered.tools or None,
        "tool_choice": _tool_choice(body.get("tool_choice")),
        "stream": body.get("stream"),
        "max_tokens": max_output_tokens,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "prompt_cache_key": body.get("prompt_cache_key"),
        "response_format": response_format_body(_text_format(body), "text.format"),
        "chat_template_kwargs": body.get("chat_template_kwargs"),
        THINKING_SWITCH: _enable_thinking(body, reasoning),
    }
    chat_body = {key: value for key, value in chat_body.items() if value is not None}
    chat = parse_chat_request(chat_body)
    echo = {
        "instructions": instructions,
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice", "auto"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": max_output_tokens,
        "metadata": metadata or {},
        "store": store,
        "parallel_tool_calls": get_field(body, "parallel_tool_calls", bool, "a boolean", True),
        "text": {"format": _text_format(body) or {"type": "text"}},
        "reasoning": {"effort": reasoning.get("effort"), "summary": summary},
    }
    if offered.dropped:
        # Outside `metadata`, which is the client's own to set and read back: an extension field, as
        # chat completions' `usage.swarmkv`, that every snapshot of the response carries.
        echo["swarmkv"] = {"dropped_tools": offered.dropped}
    return ResponsesRequest(
        chat,
        chat_body,
        items,
        echo,
        store,
        previous_response_id(body),
        offered.namespaces,
        offered.dropped,
        summary is not None,
    )


def _text_format(body: dict[str, Any]) -> Any:
    """The body's `text.format` (None when absent)."""
    return get_field(body, "text", dict, "an object", {}).get("format")


def _enable_thinking(body: dict[str, Any], reasoning: dict[str, Any]) -> Any:
    """The body's `enable_thinking`; else false for `reasoning.effort: "none"` (the Responses API's way to
    ask for no reasoning) unless `chat_template_kwargs` sets the switch itself; else None (the template's
    default)."""
    if body.get(THINKING_SWITCH) is not None:
        return body[THINKING_SWITCH]
    kwargs = body.get("chat_template_kwargs")
    if reasoning.get("effort") == "none" and not (isinstance(kwargs, dict) and THINKING_SWITCH in kwargs):
        return False
    return None


def _refuse_unsupported(body: dict[str, Any]) -> None:
    """Fields whose values this server cannot honour: a 400 rather than a silently different reply."""
    if body.get("background"):
        raise bad_request("background responses are not supported", param="background")


def _input_items(raw: Any) -> list[Item]:
    """`input` as a list of items: a string is one user message."""
    if isinstance(raw, str):
        return [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise bad_request("'input' must be a string or a non-empty array of items", param="input")
    return [parse_item(f"input[{i}]", item) for i, item in enumerate(raw)]


def parse_item(where: str, item: Any) -> Item:
    """One input (or stored output) item, normalised: message content as one string."""
    if not isinstance(item, dict):
        raise bad_request(f"{where} must be an object, got {type_name(item)}", param=where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", param=where)
        return {"type": "message", "role": role, "content": _text(where, item.get("content"))}
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise bad_request(f"{where}.{key} must be a string", param=f"{where}.{key}")
        call = {key: item[key] for key in ("type", "call_id", "name", "arguments")}
        namespace = item.get("namespace")
        if namespace is not None:
            if not isinstance(namespace, str):
                raise bad_request(f"{where}.namespace must be a string", param=f"{where}.namespace")
            call["namespace"] = namespace
        return call
    if kind == "reasoning":
        return {"type": kind, "text": _reasoning_text(where, item)}
    if kind == "function_call_output":
        if not isinstance(item.get("call_id"), str):
            raise bad_request(f"{where}.call_id must be a string", param=f"{where}.call_id")
        output = _text(f"{where}.output", item.get("output"))
        return {"type": kind, "call_id": item["call_id"], "output": output}
    if kind in _MEDIA_PARTS:
        raise bad_request(f"{where}: {kind} is not supported: swarmkv runs the text model only", param=where)
    raise bad_request(
        f"{where}: item type {kind!r} is not supported (allowed: message, function_call, function_call_output, "
        "reasoning)",
        param=where,
    )


def _text(where: str, content: Any) -> str:
    """Message text: a string, or text parts joined with newlines as chat completions joins them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or an array of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _MEDIA_PARTS:
            raise bad_request(
                f"{where}[{j}]: {kind} parts are not supported: swarmkv runs the text model only",
                param=where,
            )
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}] must be an input_text or output_text part", param=where)
        texts.append(part["text"])
    return "\n".join(texts)


def _reasoning_text(where: str, item: dict[str, Any]) -> str:
    """A reasoning item's text: its `reasoning_text` content (what this server returns and Codex CLI sends
    back), else its summary texts joined with newlines; an item with neither (only encrypted content, which
    only OpenAI can read) has none."""
    content = item.get("content")
    parts, kinds = (content, _REASONING_PARTS) if content else (item.get("summary") or [], ("summary_text",))
    if not isinstance(parts, list):
        raise bad_request(f"{where}: a reasoning item's content and summary must be arrays", param=where)
    texts = []
    for j, part in enumerate(parts):
        if (
            not isinstance(part, dict)
            or part.get("type") not in kinds
            or not isinstance(part.get("text"), str)
        ):
            raise bad_request(f"{where}: part {j} must be one of {', '.join(kinds)} with a text", param=where)
        texts.append(part["text"])
    return "\n".join(texts)


def items_to_messages(items: list[Item]) -> list[Message]:
    """Normalised items as chat messages; consecutive calls join the assistant turn before them, and a
    reasoning item opens the assistant turn that its message and calls then join."""
    messages: list[Message] = []
    for item in items:
        last = messages[-1] if messages else None
        if item["type"] == "reasoning":
            if item["text"]:
                messages.append({"role": "assistant", "content": None, "reasoning_content": item["text"]})
        elif item["type"] == "message":
            if item["role"] == "assistant" and last is not None and _only_reasoning(last):
                last["content"] = item["content"]
            else:
                messages.append({"role": item["role"], "content": item["content"]})
        elif item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def _only_reasoning(message: Message) -> bool:
    """Whether a chat message is an assistant turn holding only its reasoning so far."""
    return (
        message["role"] == "assistant"
        and message["content"] is None
        and "reasoning_content" in message
        and "tool_calls" not in message
    )


# Tool types a client runs and the model calls by name; every other type is one the provider runs (hosted).
_FUNCTION = "function"
_NAMESPACE = "namespace"


@dataclass(frozen=True)
class OfferedTools:
    """A request's tools as chat function tools, which namespace each function came from, what was dropped."""

    tools: list[dict[str, Any]]
    namespaces: dict[str, str]
    dropped: list[str]


def _tools(tools: list[Any] | None, hosted_tools: HostedToolsPolicy) -> OfferedTools:
    """Responses tools as chat function tools: functions as they are, a namespace's functions under their own
    names (the model writes plain names; the call comes back with its namespace); hosted tools dropped or
    refused. Two functions offered under one name are a 400, since a call could not say which it meant."""
    check_num_tools(len(tools or ()))
    offered = OfferedTools([], {}, [])
    names: set[str] = set()  # the functions offered so far, for the check of duplicates
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == _FUNCTION:
            _offer(offered, names, where, tool, None)
        elif kind == _NAMESPACE:
            name = tool.get("name")
            if not isinstance(name, str) or not name:
                raise bad_request(f"{where}.name must be a non-empty string", param=where)
            members = tool.get("tools")
            if not isinstance(members, list):
                raise bad_request(f"{where}.tools must be an array of function tools", param=where)
            check_num_tools(len(offered.tools) + len(members), where)  # each member is a tool of its own
            for j, member in enumerate(members):
                member_where = f"{where}.tools[{j}]"
                if not isinstance(member, dict) or member.get("type", _FUNCTION) != _FUNCTION:
                    raise bad_request(f"{member_where} must be a function tool", param=member_where)
                _offer(offered, names, member_where, member, name)
        elif isinstance(kind, str) and hosted_tools == "drop":
            offered.dropped.append(f"{where}: {kind}")
        else:
            raise bad_request(
                f"{where}: tool type {kind!r} is not supported: only 'function' and 'namespace' tools are "
                "(swarmkv runs no hosted tools; `--hosted-tools drop` leaves them out of the prompt)",
                param=where,
            )
    return offered


def _offer(
    offered: OfferedTools, names: set[str], where: str, tool: dict[str, Any], namespace: str | None
) -> None:
    """Add one function tool, offered under its own name, to `offered` (whose function names are `names`)."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{where}.name must be a non-empty string", param=where)
    if name in names:
        raise bad_request(
            f"{where}: a second function named {name!r}; the model calls functions by name, so names must "
            "be unique across the tools and their namespaces",
            param=where,
        )
    function = {"name": name, "parameters": tool.get("parameters") or {}}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    if tool.get("strict") is True:  # asked for outright: schema keywords the grammar cannot enforce are a 400
        function["strict"] = True
    offered.tools.append({"type": "function", "function": function})
    names.add(name)
    if namespace is not None:
        offered.namespaces[name] = namespace


def _tool_choice(choice: Any) -> Any:
    """Responses' tool_choice as chat's."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        "tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
        param="tool_choice",
    )
