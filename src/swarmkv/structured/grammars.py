"""Grammars for constrained decoding, as llguidance grammar text: a JSON schema, any JSON object, tool calls.

Every grammar is checked here, once per distinct text (cached), so a schema the library cannot honour is
an UnsupportedSchemaError naming the feature before the request is queued, never a silent unconstrained
run. JSON is written with fixed separators (", " and ": ", no free whitespace): that is how `json.dumps`
and the models' own tool-call examples write it, it leaves no room for runs of blank lines, and it makes
keys and punctuation forced tokens the engine appends without sampling.

Tool calls follow the chat template's format (`api/tool_formats.py`): a Hermes `<tool_call>` JSON object
naming one of the tools with arguments under its schema, or Qwen3.5's XML (`<function=NAME>`, one
`<parameter=KEY>` per argument, text values). A call may follow free text (`tool_call_grammar`'s
`free_text`), which stays unconstrained until the model opens a call.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from typing import Any, Literal

import llguidance

from swarmkv.errors import InvalidRequestError

ToolCallFormat = Literal["hermes", "xml"]

# llguidance's JSON options: fixed separators and no free whitespace.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
THINK_TAGS = ("<think>", "</think>")
OPEN_CALL = f"{OPEN_TAG}\n"
CLOSE_CALL = f"\n{CLOSE_TAG}"
XML_PARAM_CLOSE = "\n</parameter>\n"


class UnsupportedSchemaError(InvalidRequestError):
    """A JSON schema uses a feature the grammar engine cannot enforce (the message names it)."""


def json_schema_grammar(schema: Mapping[str, Any], strict: bool = True, where: str = "schema") -> str:
    """The grammar of JSON text valid under `schema`. `strict` refuses any keyword the engine cannot
    enforce; otherwise such keywords are ignored (the output is still valid JSON of the schema's shape)."""
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(f"{where} must be a JSON schema object")
    return _checked(_lark(f"start: {json_schema_rule(schema, strict)}\n"), where)


def json_schema_rule(schema: Mapping[str, Any] | None, strict: bool = True) -> str:
    """The grammar rule body (`%json {...}`) of JSON text under `schema`, to use inside a larger grammar."""
    return _json_rule(schema if schema is not None else {"type": "object"}, strict)


def json_object_grammar() -> str:
    """The grammar of any JSON object (`response_format: json_object`)."""
    return json_schema_grammar({"type": "object"})


def tool_call_grammar(
    tools: list[Mapping[str, Any]],
    fmt: ToolCallFormat,
    free_text: bool,
    strict_tools: frozenset[str] = frozenset(),
    opened: bool = False,
    reply: str | None = None,
    special: frozenset[str] = frozenset(),
) -> str:
    """The grammar of a reply that calls one of `tools` (OpenAI function objects) in `fmt`.

    `free_text`: free text first, then optionally one or more calls (tool_choice auto); otherwise the
    reply is calls only (tool_choice required or a named tool, given as the one tool). `opened`: the
    prompt already ends with the first call's `<tool_call>\\n` (a forced call), so the grammar starts
    inside it. Tools named in `strict_tools` refuse schema keywords the engine cannot enforce. `reply`
    (a rule body such as `json_schema_rule`'s), with `free_text`: the reply is that instead of text, or calls.
    `special`: the markup (`<tool_call>`, `<think>`, ...) the vocabulary holds as one special token, which
    the grammar then names as that token (its text spelled out is never that token).
    """
    calls = []
    for tool in tools:
        name = tool["name"]
        schema = tool.get("parameters") or {"type": "object"}
        strict = name in strict_tools
        where = f"tool {name!r} parameters"
        calls.append(
            _hermes_call(name, schema, strict, where) if fmt == "hermes" else _xml_call(name, schema, strict)
        )
    body = " | ".join(f"call_{i}" for i in range(len(calls)))
    rules = [f"call: {body}"] + [f"call_{i}: {c}" for i, c in enumerate(calls)]
    if fmt == "xml":
        rules.append(f"xml_text[lazy]: /(?s:.*)/ {_quote(XML_PARAM_CLOSE)}")

    def markup(tag: str) -> str:
        return tag if tag in special else _quote(tag)

    open_call = f'{markup(OPEN_TAG)} "\\n"'
    close = f'"\\n" {markup(CLOSE_TAG)}'
    more = f'("\\n" {open_call} call {close})*'
    if free_text and reply is not None:
        start = f"start: {reply} | {open_call} call {close} {more}"
    elif free_text and OPEN_TAG in special:
        # Free text is bytes (and a thinking model's tags, where they are special tokens too), so it never
        # holds the opening token: the call starts where the model writes that token.
        thinking = [markup(t) for t in THINK_TAGS if t in special]
        free = f"(TEXT | {' | '.join(thinking)})*" if thinking else "TEXT"
        start = f"start: {free} | {free} {open_call} call {close} {more}"
        rules.append("TEXT: /(?s:.*)/")
    elif free_text:
        # Text up to the first call opening is free: the lazy rule ends at the opening's first match.
        start = f"start: TEXT | text call {close} {more}\ntext[lazy]: /(?s:.*)/ {open_call}"
        rules.append("TEXT: /(?s:.*)/")
    elif opened:
        start = f"start: call {close} {more}"
    else:
        start = f"start: {open_call} call {close} {more}"
    return _checked(_lark("\n".join([start, *rules]) + "\n"), "tools")


def _hermes_call(name: str, schema: Mapping[str, Any], strict: bool, where: str) -> str:
    arguments, defs = _split_defs(_checked_schema(schema, where))
    call = {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **defs,  # at the root, where the arguments' "#/$defs/..." references point
    }
    return _json_rule(call, strict)


def _split_defs(schema: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A schema without its `$defs` / `definitions`, and those, to put at the root of a schema embedding it."""
    keys = ("$defs", "definitions")
    return {k: v for k, v in schema.items() if k not in keys}, {k: schema[k] for k in keys if k in schema}


def _xml_call(name: str, schema: Mapping[str, Any], strict: bool) -> str:
    """`<function=NAME>` then each property as `<parameter=KEY>\\nVALUE\\n</parameter>` in the schema's
    order (required ones always, the others optional), then `</function>`; a string value is text without
    a closing tag, any other value JSON under its property schema (the parser types it back)."""
    raw = schema.get("properties")
    properties: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    _, defs = _split_defs(schema)
    required = set(schema.get("required") or ())
    parts = [_quote(f"<function={name}>\n")]
    for key, prop in properties.items():
        kind = prop.get("type") if isinstance(prop, Mapping) else None
        opening = _quote(f"<parameter={key}>\n")
        if kind == "string" and not {"enum", "const", "pattern", "format"} & set(prop):
            part = f"({opening} xml_text)"  # the text runs to the first closing tag
        else:
            value = _json_rule({**(prop if isinstance(prop, Mapping) else {}), **defs}, strict)
            part = f"({opening} {value} {_quote(XML_PARAM_CLOSE)})"
        parts.append(part if key in required else f"{part}?")
    parts.append(_quote("</function>"))
    return " ".join(parts)


def _checked_schema(schema: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    if not isinstance(schema, Mapping):
        raise InvalidRequestError(f"{where} must be a JSON schema object")
    return schema


def _json_rule(schema: Mapping[str, Any], strict: bool) -> str:
    options = {**JSON_OPTIONS, "lenient": not strict}
    bounded = _safe_integers(schema)
    merged = {**bounded, "x-guidance": {**options, **(schema.get("x-guidance") or {})}}
    return f"%json {json.dumps(merged, sort_keys=False)}"


# JavaScript's safe integers: an integer without bounds stays within them, so a small model cannot run on
# writing digits (it does: "population": 1111...) and every client reads the value exactly.
MAX_SAFE_INTEGER = 2**53 - 1
_DATA_KEYWORDS = frozenset({"enum", "const", "default", "examples"})  # their values are data, not schemas


def _safe_integers(schema: Any) -> Any:
    """`schema` with every `"type": "integer"` lacking a bound given +-MAX_SAFE_INTEGER."""
    if isinstance(schema, list):
        return [_safe_integers(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {key: value if key in _DATA_KEYWORDS else _safe_integers(value) for key, value in schema.items()}
    if out.get("type") == "integer":
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = MAX_SAFE_INTEGER
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -MAX_SAFE_INTEGER
    return out


def _lark(text: str) -> str:
    return str(llguidance.LLMatcher.grammar_from_lark(text))


def _quote(text: str) -> str:
    return json.dumps(text)


def _checked(grammar: str, where: str) -> str:
    error = _grammar_error(grammar)
    if error:
        raise UnsupportedSchemaError(f"{where}: {_feature_message(error)}")
    return grammar


@lru_cache(maxsize=1024)
def _grammar_error(grammar: str) -> str:
    """llguidance's complaint about a grammar (empty when it compiles); checked without a tokenizer."""
    return str(llguidance.LLMatcher.validate_grammar(grammar))


def _feature_message(error: str) -> str:
    """The library's first line, which names the keyword ('Unimplemented keys: ["dependentSchemas"]')."""
    line = next((ln.strip() for ln in error.splitlines() if ln.strip()), error)
    return f"unsupported JSON schema feature for constrained decoding ({line})"
