"""How much one request may ask the parsers to read: tools, and a JSON schema's size and nesting; over a bound
is a typed 400 before any per-item work.

Parsing runs on the event loop, so each check here counts first and stops at the bound: the work a body can
cause is linear in it and capped, whatever the body's size (`docs/security.md` lists the bounds). A body's
top-level arrays (tools, stops) are counted by `check_array_counts`, which each parser calls first and the
server calls again where it decodes a large body, so that such a body is refused before it is handed over.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Literal

from swarmkv.api.errors import bad_request


def _limit(default: int, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class RequestLimits:
    """The bounds every protocol's parser applies to a request body."""

    max_tools: int = _limit(
        1024,
        "tools one request may offer (a Responses namespace's functions count one each); OpenAI allows 128, "
        "and harnesses with many MCP servers send a few hundred",
    )
    max_schema_nodes: int = _limit(
        100_000,
        "JSON values (objects, arrays, strings, numbers) in all of a request's tool schemas together, and in "
        "its response format's schema; a coding harness's 20 to 60 tools hold a few thousand",
    )
    max_schema_depth: int = _limit(
        64,
        "levels of nesting in one schema (each object or array is a level); real tool schemas nest under 20",
    )
    max_stop_sequences: int = _limit(
        64,
        "stop sequences one request may give: every decoding step looks for each in the new text, so a million "
        "one-character stops would stall the engine for every request; OpenAI allows 4",
    )


LIMITS = RequestLimits()


def check_num_tools(num_tools: int, param: str = "tools", limits: RequestLimits = LIMITS) -> None:
    """A 400 when a request offers more tools than `limits.max_tools`; checked before any tool is read."""
    if num_tools > limits.max_tools:
        raise bad_request(
            f"at most {limits.max_tools} tools may be offered, got {num_tools}",
            param=param,
            code="too_many_tools",
        )


def check_num_stops(num_stops: int, param: str = "stop", limits: RequestLimits = LIMITS) -> None:
    """A 400 when a request gives more stop sequences than `limits.max_stop_sequences`; checked before any is
    read."""
    if num_stops > limits.max_stop_sequences:
        raise bad_request(
            f"at most {limits.max_stop_sequences} stop sequences, got {num_stops}",
            param=param,
            code="too_many_stops",
        )


# The top-level arrays `check_array_counts` bounds, and the check each takes.
_COUNTED_ARRAYS = {"tools": check_num_tools, "stop": check_num_stops, "stop_sequences": check_num_stops}


def check_array_counts(body: Any, names: Collection[str], limits: RequestLimits = LIMITS) -> None:
    """A 400 when one of `names`, top-level arrays of decoded `body` ("tools", "stop", "stop_sequences"),
    holds more items than its bound; a value that is not an array is left to the parser. Constant time: only
    the arrays' lengths are read."""
    if not isinstance(body, dict):
        return
    for name in names:
        value = body.get(name)
        if isinstance(value, list):
            _COUNTED_ARRAYS[name](len(value), name, limits)


class SchemaBudget:
    """The schema nodes a request has left: each schema checked spends from one budget, so all of a
    request's schemas together stay within `max_schema_nodes`."""

    def __init__(self, limits: RequestLimits = LIMITS) -> None:
        self.limits = limits
        self.nodes_left = limits.max_schema_nodes

    def check(self, schema: Any, param: str) -> None:
        """A 400 when `schema` nests deeper than `max_schema_depth` or passes the request's node budget; an
        iterative walk that stops at the first bound it passes."""
        counted = count_json_values(schema, self.limits.max_schema_depth, self.nodes_left)
        if counted == "depth":
            raise bad_request(
                f"{param}: a JSON schema may nest at most {self.limits.max_schema_depth} levels deep",
                param=param,
                code="schema_too_deep",
            )
        if counted == "nodes":
            raise bad_request(
                f"{param}: a request's JSON schemas may hold at most {self.limits.max_schema_nodes} values "
                "together",
                param=param,
                code="schema_too_large",
            )
        self.nodes_left -= counted


def count_json_values(value: Any, max_depth: int, max_nodes: int) -> int | Literal["depth", "nodes"]:
    """The number of JSON values in decoded `value` (itself included), or the bound it passes first: "depth"
    for an object or array nested more than `max_depth` deep, "nodes" for more than `max_nodes` values.
    Iterative, and counted as children are reached, so the walk is never longer than the bounds."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    num_values = 1
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, dict | list):
            continue
        if depth > max_depth:
            return "depth"
        num_values += len(node)
        if num_values > max_nodes:
            return "nodes"
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children)
    return num_values if num_values <= max_nodes else "nodes"
