"""Structured outputs in a request: `response_format` (chat completions; Responses' `text.format` and
Messages' `output_config.format` are rewritten into it) and the grammar a chat request's reply follows.

A reply is constrained when the body asks for JSON (`json_object`, `json_schema`), and whenever tools are
offered: a call the model writes follows the chosen tool's schema in the template's own tool-call format,
with free text before it (tool_choice auto) or as the whole reply (required, a named tool). A tool whose
definition says `strict: true`, or a `json_schema` with `strict`, refuses schema keywords the grammar cannot
enforce with a 400 naming them; elsewhere such keywords are left unenforced (the JSON still parses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from swarmkv.api.errors import APIError, bad_request, get_field
from swarmkv.api.limits import SchemaBudget
from swarmkv.structured.grammars import (
    CLOSE_TAG,
    OPEN_TAG,
    THINK_TAGS,
    UnsupportedSchemaError,
    json_object_grammar,
    json_schema_grammar,
    json_schema_rule,
    tool_call_grammar,
)

if TYPE_CHECKING:
    from swarmkv.api.chat_request import ChatRequest
    from swarmkv.tokenizer import Tokenizer


@dataclass(frozen=True)
class ResponseFormat:
    """A validated `response_format`: JSON under a schema, any JSON object, or (None) text."""

    kind: Literal["json_object", "json_schema"]
    schema: dict[str, Any] | None = None
    strict: bool = False
    name: str | None = None


@dataclass(frozen=True)
class Constraint:
    """The grammar a reply follows, and the text of it the prompt already wrote (a forced call's opening)."""

    grammar: str
    prefix: str = ""


def parse_response_format(body: dict[str, Any], param: str = "response_format") -> ResponseFormat | None:
    """`response_format` as OpenAI's chat completions spells it; None for text or when absent."""
    value = get_field(body, "response_format", dict, "an object")
    if value is None or value.get("type", "text") == "text":
        return None
    kind = value.get("type")
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(f"{param}.json_schema must be an object with a 'schema'", param=param)
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad_request(f"{param}.json_schema.schema must be a JSON schema object", param=param)
        SchemaBudget().check(schema, f"{param}.json_schema.schema")
        strict = get_field(spec, "strict", bool, "a boolean", False)
        name = get_field(spec, "name", str, "a string")
        return ResponseFormat("json_schema", schema, strict, name)
    raise bad_request(
        f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param=param
    )


def response_format_body(fmt: Any, param: str) -> dict[str, Any] | None:
    """Responses' `text.format` or Messages' `output_config.format` ({"type": "json_schema", "schema": ...,
    "name"?, "strict"?}) as chat completions' `response_format`; None for text."""
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request(f"{param} must be an object", param=param)
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {key: fmt[key] for key in ("name", "schema", "strict") if key in fmt}
        if not isinstance(spec.get("schema"), dict):
            raise bad_request(f"{param}.schema must be a JSON schema object", param=param)
        return {"type": "json_schema", "json_schema": spec}
    raise bad_request(
        f"{param}.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", param=param
    )


def special_markup(tokenizer: Tokenizer) -> frozenset[str]:
    """The tool-call and thinking tags this vocabulary holds as added (special) tokens."""
    added = {t.content for t in tokenizer.backend.get_added_tokens_decoder().values()}
    return frozenset(tag for tag in (OPEN_TAG, CLOSE_TAG, *THINK_TAGS) if tag in added)


def reply_constraint(
    req: ChatRequest, special: frozenset[str] = frozenset(), strict_only: bool = False
) -> Constraint | None:
    """The grammar of this request's reply (after `render_request`, so its tool format is the template's);
    None when unconstrained. A schema the grammar cannot enforce where strictness was asked is a 400.
    `strict_only` (`--tool-call-grammar strict`): tool calls follow a grammar only when a tool is strict or
    tool_choice forces a call."""
    try:
        return _constraint(req, special, strict_only)
    except UnsupportedSchemaError as exc:
        raise _unsupported(exc, req) from exc


def _constraint(req: ChatRequest, special: frozenset[str], strict_only: bool) -> Constraint | None:
    fmt = req.response_format
    tools = req.callable_tools
    forced = req.tool_choice.mode in ("required", "function")
    any_strict = any(t["function"].get("strict") is True for t in tools or [])
    if tools and strict_only and not forced and not any_strict and fmt is None:
        return None  # auto calls of tools none of which is strict stay free
    if tools:
        functions = [t["function"] for t in tools]
        if req.tool_choice.mode == "function":
            functions = [f for f in functions if f["name"] == req.tool_choice.name]
        strict = frozenset(f["name"] for f in functions if f.get("strict") is True)
        reply = None
        if fmt is not None and not forced:  # the reply is then the format's JSON or calls
            reply = json_schema_rule(fmt.schema or {"type": "object"}, strict=fmt.strict)
        grammar = tool_call_grammar(
            functions,
            req.tool_format,
            free_text=not forced,
            strict_tools=strict,
            reply=reply,
            special=special,
        )
        return Constraint(grammar, req.forced_call_opening())
    return format_constraint(fmt)


def format_constraint(fmt: ResponseFormat | None) -> Constraint | None:
    """The grammar of a reply in `fmt` alone (no tools); a 400 for a strict schema it cannot enforce."""
    if fmt is None:
        return None
    try:
        if fmt.kind == "json_object":
            return Constraint(json_object_grammar())
        assert fmt.schema is not None
        return Constraint(json_schema_grammar(fmt.schema, strict=fmt.strict, where="response_format"))
    except UnsupportedSchemaError as exc:
        raise bad_request(str(exc), param="response_format", code="unsupported_schema") from exc


def _unsupported(exc: UnsupportedSchemaError, req: ChatRequest) -> APIError:
    param = "tools" if req.callable_tools else "response_format"
    return bad_request(str(exc), param=param, code="unsupported_schema")
