"""Render a model's own jinja chat template exactly as transformers' `apply_chat_template` does.

The jinja environment, filters, globals and template variables copy transformers' (trim_blocks,
lstrip_blocks, loopcontrols, `{% generation %}`, `raise_exception`, `strftime_now`, a `tojson` that
keeps non-ASCII text), and messages are normalised the same way first: keys whose value is None are
dropped and a message's reasoning is offered under `reasoning_content` and `thinking`.

Templates without tool support (the source never reads `tools`) get the Hermes format instead:

* When `tools` is given, this paragraph is appended to the first system message (after a blank
  line), or becomes a new first system message when there is none::

      # Tools

      You may call one or more functions to assist with the user query.

      You are provided with function signatures within <tools></tools> XML tags:
      <tools>
      {"type": "function", "function": {...}}      <- one tool per line, JSON as `tojson` writes it
      </tools>

      For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
      <tool_call>
      {"name": <function-name>, "arguments": <args-json-object>}
      </tool_call>

* When the template also never reads `tool_calls`, an assistant message's tool calls are folded into
  its content as `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` blocks (one per line,
  after the text), so the model sees the calls it made. Tool results (role "tool") are passed on
  unchanged and render however the template renders that role.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from swarmkv.errors import InvalidRequestError

# Texts that no real conversation holds, for the system-turn probe.
_PROBE_USER, _PROBE_SYSTEM, _PROBE_NEXT = "swarmkv-probe-user", "swarmkv-probe-system", "swarmkv-probe-next"
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call>"
)


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """JSON for templates; unlike jinja's own filter it leaves `<`, `>` and `&` and non-ASCII text alone."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates, without the class object itself (and its attributes) in reach."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, which could reach CPython internals."""

    # No named `self`, as in jinja's Namespace, so that `namespace(self=...)` still works.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set namespace attribute {name!r}")


class _GenerationTag(jinja2.ext.Extension):
    """Accept `{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker) and render its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _normalize_message(message: Any) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"each chat message must be an object, got {type(message).__name__}")
    normalized = {key: value for key, value in message.items() if value is not None}
    # OpenAI clients send `content: null` beside tool calls; templates that read the content fail on
    # a missing key (transformers too), so such a message gets empty text instead.
    if normalized.get("tool_calls") and "content" not in normalized:
        normalized["content"] = ""
    reasoning = next((normalized[key] for key in _REASONING_FIELDS if key in normalized), None)
    if reasoning is not None:
        normalized = {"thinking": reasoning, **normalized, "reasoning_content": reasoning}
    return normalized


def _tools_paragraph(tools: list[dict[str, Any]]) -> str:
    return _TOOLS_HEADER + "".join("\n" + tojson(tool) for tool in tools) + _TOOLS_FOOTER


def _with_tools_in_system(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    paragraph = _tools_paragraph(tools)
    if messages and messages[0].get("role") == "system":
        content = messages[0].get("content", "")
        if isinstance(content, list):
            content = [*content, {"type": "text", "text": "\n\n" + paragraph}]
        else:
            content = f"{content}\n\n{paragraph}" if content else paragraph
        return [{**messages[0], "content": content}, *messages[1:]]
    return [{"role": "system", "content": paragraph}, *messages]


def _tool_call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    arguments_json = arguments if isinstance(arguments, str) else tojson(arguments)
    name_json = tojson(function.get("name", ""))
    return f'<tool_call>\n{{"name": {name_json}, "arguments": {arguments_json}}}\n</tool_call>'


def _fold_tool_calls(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not calls:
        return message
    text = message.get("content") or ""
    blocks = "\n".join(_tool_call_text(call) for call in calls)
    folded = {key: value for key, value in message.items() if key != "tool_calls"}
    folded["content"] = f"{text}\n{blocks}" if text else blocks
    return folded


@dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template: the jinja source, compiled once on first use, and the special tokens it sees."""

    source: str
    # Named "tool_use" template some tokenizer_config.json files carry beside the default one.
    tool_use_source: str | None = None
    # (name, text) pairs such as ("eos_token", "<|im_end|>"), passed to the template as variables.
    special_tokens: tuple[tuple[str, str], ...] = ()

    @cached_property
    def _environment(self) -> ImmutableSandboxedEnvironment:
        return _environment()

    @cached_property
    def _compiled(self) -> jinja2.Template:
        return self._compile(self.source)

    @cached_property
    def _compiled_tool_use(self) -> jinja2.Template:
        assert self.tool_use_source is not None
        return self._compile(self.tool_use_source)

    def _compile(self, source: str) -> jinja2.Template:
        try:
            return self._environment.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequestError(f"the model's chat template does not compile: {exc}") from exc

    def reads(self, variable: str) -> bool:
        """Whether the template (or its tool_use twin) reads the template variable `variable`."""
        sources = (self.source, self.tool_use_source) if self.tool_use_source is not None else (self.source,)
        return any(self._reads(source, variable) for source in sources)

    @cached_property
    def renders_system_in_place(self) -> bool:
        """Whether a system message after a user turn renders where it stands (Qwen3's does; many raise)."""
        probe = [
            {"role": "user", "content": _PROBE_USER},
            {"role": "system", "content": _PROBE_SYSTEM},
            {"role": "user", "content": _PROBE_NEXT},
        ]
        try:
            text = self.render(probe)
        except InvalidRequestError:
            return False
        return _PROBE_USER in text and text.find(_PROBE_USER) < text.find(_PROBE_SYSTEM) < text.find(
            _PROBE_NEXT
        )

    def _reads(self, source: str, variable: str) -> bool:
        try:
            names = jinja2.meta.find_undeclared_variables(self._environment.parse(source))
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequestError(f"the model's chat template does not compile: {exc}") from exc
        return variable in names

    @cached_property
    def supports_tools(self) -> bool:
        """Whether the template itself renders the `tools` list."""
        return self.tool_use_source is not None or self._reads(self.source, "tools")

    @cached_property
    def _renders_tool_calls(self) -> bool:
        # `tool_calls` is an attribute of a message, not a template variable, so search the source.
        return "tool_calls" in self.source

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """The prompt text for `messages`, byte-identical to transformers' `apply_chat_template(tokenize=False)`."""
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("a chat needs a non-empty list of messages")
        chat = [_normalize_message(message) for message in messages]
        template = self._compiled
        if tools is not None and self.tool_use_source is not None:
            template = self._compiled_tool_use
        elif not self.supports_tools:
            if tools:
                chat = _with_tools_in_system(chat, tools)
            tools = None
            if not self._renders_tool_calls:
                chat = [_fold_tool_calls(message) for message in chat]
        documents = kwargs.pop("documents", None)
        variables = {**dict(self.special_tokens), **kwargs}
        try:
            return template.render(
                messages=chat,
                tools=tools,
                documents=documents,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}") from exc
