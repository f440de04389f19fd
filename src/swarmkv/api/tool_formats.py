"""Which tool-call format a model writes, chosen from its chat template, and schema-typed parameter values.

Qwen3, SmolLM2 and other Hermes-style templates ask for a JSON object inside `<tool_call>`; Qwen3.5 and
Qwen3-Coder ask for XML (`<function=NAME>` with one `<parameter=KEY>` per argument), whose values are text.
A template that writes `<function=` in its instructions or its history is the XML family.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Literal

ToolFormat = Literal["hermes", "xml"]

XML_FUNCTION_MARK = "<function="


def tool_format_of(template_source: str | None) -> ToolFormat:
    """The tool-call format a chat template asks its model for; Hermes JSON unless it writes `<function=`."""
    return "xml" if template_source is not None and XML_FUNCTION_MARK in template_source else "hermes"


def parameter_schemas(tools: list[dict[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """Each offered function's `parameters.properties` (name -> property schema), by function name."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        function = tool.get("function")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        out[function["name"]] = properties if isinstance(properties, dict) else {}
    return out


def _schema_type(schema: Any) -> str | None:
    """A property schema's type; of a union such as ["integer", "null"], the first that is not null."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else None


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as its schema's type says; the text itself when there is no type or it does not fit.

    Values the model writes as text (`42`, `true`, `{"a": 1}`) become the JSON value a JSON-writing model
    would have sent, so clients see the same arguments from either family.
    """
    kind = _schema_type(schema)
    if kind is None or kind == "string":
        return text
    stripped = text.strip()
    if stripped.lower() == "null":
        return None
    if kind == "integer":
        try:
            return int(stripped)
        except ValueError:
            return text
    if kind == "number":
        try:
            number = float(stripped)
        except ValueError:
            return text
        return int(number) if number.is_integer() and not any(c in stripped for c in ".eE") else number
    if kind == "boolean":
        return {"true": True, "false": False}.get(stripped.lower(), text)
    if kind in ("object", "array"):
        try:
            return json.loads(stripped)
        except ValueError:
            return text
    return text
