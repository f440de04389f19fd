"""The /v1/chat/completions body: messages normalised for the chat template, tools, tool_choice and the
template's own switches (vLLM's `chat_template_kwargs`, and `enable_thinking`)."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from swarmkv.api.errors import bad_request, get_field, type_name
from swarmkv.api.limits import SchemaBudget, check_array_counts, check_num_tools
from swarmkv.api.options import Options, parse_options
from swarmkv.api.reasoning import CLOSE_THINK, THINKING_SWITCH
from swarmkv.api.structured_request import ResponseFormat, parse_response_format
from swarmkv.api.tool_formats import XML_FUNCTION_MARK, ToolFormat, tool_format_of
from swarmkv.api.tool_parser import CLOSE_TAG, OPEN_TAG
from swarmkv.api.xml_call_stream import PARAM_OPEN

Message = dict[str, Any]


@dataclass(frozen=True)
class ToolChoice:
    """OpenAI's tool_choice: "function" names one tool the reply must call."""

    mode: Literal["none", "auto", "required", "function"]
    name: str | None = None


@dataclass(frozen=True)
class ChatRequest:
    """A validated /v1/chat/completions body."""

    options: Options
    messages: list[Message]
    tools: list[dict[str, Any]] | None
    tool_choice: ToolChoice
    diagnostics: bool = False  # `swarmkv_diagnostics`: add `usage.swarmkv` (the cache break, if any)
    # The chat template's own switches: `chat_template_kwargs`, with a top-level `enable_thinking` in it.
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # The tool-call format the model writes, from its chat template (`for_template`); a forced call opens in it.
    tool_format: ToolFormat = "hermes"
    # Whether the prompt ends inside an open `<think>` (Qwen3.5's generation prompt), which a forced call's
    # opening closes first, so the call is not written as reasoning.
    closes_thinking: bool = False
    response_format: ResponseFormat | None = None  # JSON the reply must be (or None: text)
    # Tools the model may call that the prompt's tool block does not render: deferred ones (Messages'
    # `defer_loading`) a tool search loaded; their definitions stand in the tool results that loaded them.
    loaded_tools: list[dict[str, Any]] | None = None

    def for_template(self, template_source: str | None) -> ChatRequest:
        """This request for a model with this chat template: its forced call opens in the template's format."""
        return replace(self, tool_format=tool_format_of(template_source))

    def closing_thinking(self) -> ChatRequest:
        """This request for a prompt that ends inside `<think>`: a forced call's opening closes the block."""
        return replace(self, closes_thinking=True)

    @property
    def thinking_enabled(self) -> bool:
        """Whether the template's thinking switch is left on (a template's default is on where it has one)."""
        return self.template_kwargs.get(THINKING_SWITCH) is not False

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders: the request's, unless tool_choice "none" switched them off."""
        return self.tools if self.tool_choice.mode != "none" else None

    @property
    def callable_tools(self) -> list[dict[str, Any]] | None:
        """The tools a reply may call: those the template renders, and deferred ones loaded since."""
        if self.tool_choice.mode == "none" or not (self.tools or self.loaded_tools):
            return None
        return [*(self.tools or []), *(self.loaded_tools or [])]

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the reply is scanned for tool calls (tools offered and not switched off)."""
        return bool(self.callable_tools)

    def forced_prefix(self) -> str:
        """Reply text written for the model when the call is required, so that it completes one call: the
        call's opening (`forced_call_opening`), after the `</think>` that closes a block the prompt opened."""
        opening = self.forced_call_opening()
        # The empty block a thinking template writes when thinking is off: `<think>\n\n</think>\n\n`.
        return f"\n{CLOSE_THINK}\n\n{opening}" if opening and self.closes_thinking else opening

    def forced_call_opening(self) -> str:
        """The start of the one call a forced reply makes, in the model's own format; what the parser reads.

        Without constrained decoding, "required" and a named tool are honoured by starting the reply
        inside a tool-call block (naming the tool when it is named or the only one); the block's end stops
        generation, so the reply is one call. A named call's arguments open with what its schema fixes, the
        first required property's key, which keeps small models to the schema's names. The block is a Hermes
        JSON one, or for a template of the XML family (Qwen3.5, Qwen3-Coder) `<function=NAME>` and
        `<parameter=KEY>`, as that model writes its calls.
        """
        name = self.tool_choice.name
        if self.tool_choice.mode == "required" and self.tools and len(self.tools) == 1:
            name = self.tools[0]["function"]["name"]
        if name is not None:
            tool: dict[str, Any] = next(
                (t["function"] for t in self.tools or () if t["function"]["name"] == name), {}
            )
            if self.tool_format == "xml":
                key = _first_required_key(tool.get("parameters"))
                parameter = f"{PARAM_OPEN}{key}>\n" if key is not None else ""
                return f"{OPEN_TAG}\n{XML_FUNCTION_MARK}{name}>\n{parameter}"
            opening = _arguments_opening(tool.get("parameters"))
            return f'{OPEN_TAG}\n{{"name": {json.dumps(name)}, "arguments": {opening}'
        if self.tool_choice.mode == "required":
            return (
                f"{OPEN_TAG}\n{XML_FUNCTION_MARK}"
                if self.tool_format == "xml"
                else f'{OPEN_TAG}\n{{"name": "'
            )
        return ""

    def forced_stop(self) -> tuple[str, ...]:
        """Stop strings added to the client's for a forced call."""
        return (CLOSE_TAG,) if self.forced_prefix() else ()


def _first_required_key(schema: Any) -> str | None:
    """The first required property of a JSON schema, when the schema describes it."""
    if not isinstance(schema, dict):
        return None
    required, properties = schema.get("required"), schema.get("properties")
    if not (isinstance(required, list) and required and isinstance(properties, dict)):
        return None
    key = required[0]
    return key if isinstance(key, str) and isinstance(properties.get(key), dict) else None


def _arguments_opening(schema: Any) -> str:
    """The start of a call's arguments that its JSON schema fixes: the first required property's key, and
    the opening quote of a string value; nothing when the schema requires nothing."""
    key = _first_required_key(schema)
    if key is None:
        return ""
    quote = '"' if schema["properties"][key].get("type") == "string" else ""
    return f"{{{json.dumps(key, ensure_ascii=False)}: {quote}"


# The top-level arrays a chat body's parser counts before it reads anything (`limits.check_array_counts`).
CHAT_ARRAYS = ("tools", "stop")


def parse_chat_request(body: dict[str, Any], tools: list[dict[str, Any]] | None = None) -> ChatRequest:
    """Validate a chat completions body; `tools`, when given, are its tools already validated (`parse_tools`),
    so that a body another API's parser built is not checked twice."""
    check_array_counts(body, CHAT_ARRAYS)
    options = parse_options(body)
    messages = parse_messages(body.get("messages"))
    if tools is None:
        tools = parse_tools(body.get("tools"))
    diagnostics = get_field(body, "swarmkv_diagnostics", bool, "a boolean", False)
    choice = _tool_choice(body.get("tool_choice"), tools)
    return ChatRequest(
        options,
        messages,
        tools,
        choice,
        diagnostics,
        parse_template_kwargs(body),
        response_format=parse_response_format(body),
    )


# What the renderer itself passes to the chat template; a client's switch may not replace them.
_RENDERER_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def parse_template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The chat template's switches: vLLM's `chat_template_kwargs` object, and a top-level `enable_thinking`
    (as SGLang and DashScope take it), which must agree with the object's when both are given."""
    kwargs = dict(get_field(body, "chat_template_kwargs", dict, "an object", {}))
    for key in kwargs:
        if key in _RENDERER_VARIABLES:
            raise bad_request(
                f"chat_template_kwargs.{key} is not a template switch: the server renders it from the request",
                param=f"chat_template_kwargs.{key}",
            )
    enable_thinking = get_field(body, THINKING_SWITCH, bool, "a boolean")
    if enable_thinking is not None:
        if kwargs.get(THINKING_SWITCH, enable_thinking) != enable_thinking:
            raise bad_request(
                f"'{THINKING_SWITCH}' and 'chat_template_kwargs.{THINKING_SWITCH}' disagree",
                param=THINKING_SWITCH,
            )
        kwargs[THINKING_SWITCH] = enable_thinking
    return kwargs


def parse_messages(raw_messages: Any, allow_empty: bool = False) -> list[Message]:
    """Validate `messages` and normalise each for the chat template (a pin's head may have none)."""
    if not isinstance(raw_messages, list) or not (raw_messages or allow_empty):
        kind = "an array" if allow_empty else "a non-empty array"
        raise bad_request(f"'messages' must be {kind} of message objects", param="messages")
    return [_message(i, m) for i, m in enumerate(raw_messages)]


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _message(i: int, m: Any) -> Message:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_request(f"{where} must be an object, got {type_name(m)}", param=where)
    role = m.get("role")
    if role not in _ROLES:
        raise bad_request(
            f"{where}.role must be one of {', '.join(_ROLES)}, got {role!r}", param=f"{where}.role"
        )
    content = _content(where, m.get("content"))
    out: Message = {"role": "system" if role == "developer" else role, "content": content}
    reasoning = _reasoning_of(where, m) if role == "assistant" else None
    if reasoning is not None:
        out["reasoning_content"] = reasoning  # the name thinking templates (Qwen3's, Qwen3.5's) read
    calls = m.get("tool_calls") if role == "assistant" else None
    if calls is not None:
        if not isinstance(calls, list):
            raise bad_request(f"{where}.tool_calls must be an array", param=f"{where}.tool_calls")
        out["tool_calls"] = [_history_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    if content is None and not calls:
        if reasoning is None:
            raise bad_request(f"{where} has no content", param=f"{where}.content")
        out["content"] = ""  # a turn cut off while reasoning: templates read its content as text
    for key in ("name", "tool_call_id"):
        value = get_field(m, key, str, "a string")
        if value is not None:
            out[key] = value
    return out


def _reasoning_of(where: str, m: dict[str, Any]) -> str | None:
    """An earlier assistant turn's reasoning as a client sends it back: `reasoning_content` (what this server
    and vLLM return), or `reasoning` (vLLM's newer name)."""
    for key in ("reasoning_content", "reasoning"):
        value = m.get(key)
        if value is not None:
            if not isinstance(value, str):
                raise bad_request(f"{where}.{key} must be a string", param=f"{where}.{key}")
            return value
    return None


# Content part types of images, video and audio in OpenAI's and compatible servers' chat APIs.
_MEDIA_PARTS = frozenset({"image_url", "input_image", "image", "video", "video_url", "input_audio", "audio"})


def _content(where: str, content: Any) -> str | None:
    """Message text; an array of text parts is joined with newlines, as vLLM does."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _MEDIA_PARTS:
                raise bad_request(
                    f"{where}.content: {kind} parts are not supported: swarmkv runs the text model only (of a "
                    f"vision checkpoint such as Qwen3.5, its language model)",
                    param=f"{where}.content",
                )
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise bad_request(f"{where}.content: only text parts are supported", param=f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{where}.content must be a string or an array of text parts", param=f"{where}.content")


def _history_call(where: str, call: Any) -> dict[str, Any]:
    """A tool call of an earlier assistant turn, with its arguments decoded for the chat template."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"{where} must be {{'type': 'function', 'function': {{'name': ...}}}}", param=where)
    arguments: Any = function.get("arguments", {})
    if isinstance(arguments, str):
        # Templates expect a mapping (transformers' convention); OpenAI clients send a JSON string. Arguments
        # a model wrote that are not JSON come back as they were written, and templates render the string.
        with contextlib.suppress(ValueError, RecursionError):  # the decoder recurses once per nesting level
            arguments = json.loads(arguments) if arguments.strip() else {}
    out: dict[str, Any] = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def parse_tools(tools: Any, budget: SchemaBudget | None = None) -> list[dict[str, Any]] | None:
    """Validate `tools`: function definitions, each with a name and a JSON-schema `parameters` object, within
    the request's bounds (`api/limits.py`; their schemas spend from `budget`, a fresh one when None)."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("'tools' must be an array", param="tools")
    check_num_tools(len(tools))
    budget = budget if budget is not None else SchemaBudget()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise bad_request(
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param=f"tools[{i}]"
            )
        if not isinstance(function.get("parameters", {}), dict):
            raise bad_request(
                f"tools[{i}].function.parameters must be a JSON schema object", param=f"tools[{i}]"
            )
        budget.check(function.get("parameters", {}), f"tools[{i}]")
    return tools or None


def _tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if choice in ("none", "auto"):
        return ToolChoice(choice)
    names = [t["function"]["name"] for t in tools or []]
    if choice == "required":
        if not names:
            raise bad_request("tool_choice 'required' needs 'tools'", param="tool_choice")
        return ToolChoice("required")
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise bad_request(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    if name not in names:
        raise bad_request(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    return ToolChoice("function", name)
