"""A request log line's body, bounded: strings past a cap keep their head, and the line names each cut field
with its full length and digest; a body too big to log even so is named by its size and digest alone.

A refused request's line is at most `MAX_REFUSED_LINE_BYTES`, whatever the body (a 10 MB prompt logs about
1 KB). An accepted request's strings are capped at its prompt's length: a string longer than the prompt it
rendered into was not in it whole, so what `swarmkv lint` replays is the prompt the server ran.
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass, field
from typing import Any

from swarmkv.api.limits import count_json_values

# An accepted request's strings are kept up to its prompt's length, and at least this long (a field the
# prompt does not hold, such as `metadata`, is read back whole when short).
MIN_LOGGED_FIELD_CHARS = 4096
# A refused request's line, its body capped to fit; past it, the body is its size and digest.
MAX_REFUSED_LINE_BYTES = 64 * 1024
# What of a refused body is kept: each string's head, and at most this many values, nested this deep.
REFUSED_FIELD_CHARS = 1024
_REFUSED_MAX_VALUES = 4096
_REFUSED_MAX_DEPTH = 64


@dataclass(frozen=True)
class CutField:
    """A string of the body cut to its head: where it is, how long it was, and its digest."""

    path: str  # JSON path: messages[0].content
    chars: int  # its whole length, in characters
    kept_chars: int
    sha256: str  # of its UTF-8 text

    def to_json(self) -> dict[str, Any]:
        """The line's form: {"path", "chars", "kept_chars", "sha256"}."""
        return {"path": self.path, "chars": self.chars, "kept_chars": self.kept_chars, "sha256": self.sha256}


@dataclass
class CappedBody:
    """A body with its long strings cut, and the fields that were cut."""

    body: Any
    cut: list[CutField] = field(default_factory=list)


def cap_strings(
    body: Any, max_chars: int, max_values: int | None = None, max_depth: int | None = None
) -> CappedBody | None:
    """A copy of decoded JSON `body` with each string value longer than `max_chars` cut to its head (keys are
    kept); None when it holds more than `max_values` values or nests deeper than `max_depth`, counted first
    by `count_json_values`, which stops at the bound. Iterative, so no nesting the decoder allowed can exhaust
    the stack."""
    if max_values is not None or max_depth is not None:
        depth = max_depth if max_depth is not None else sys.maxsize
        counted = count_json_values(body, depth, max_values if max_values is not None else sys.maxsize)
        if counted == "depth" or counted == "nodes":
            return None
    out = CappedBody(None)
    # (value, path, where its copy goes: the parent copy and its key or index)
    stack: list[tuple[Any, str, Any, Any]] = [(body, "", None, None)]
    while stack:
        value, path, parent, slot = stack.pop()
        copy: Any = value
        if isinstance(value, str) and len(value) > max_chars:
            copy = value[:max_chars]
            digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
            out.cut.append(CutField(path or "body", len(value), max_chars, digest))
        elif isinstance(value, dict):
            copy = dict.fromkeys(value)
            children = [(v, f"{path}.{k}" if path else str(k), k) for k, v in value.items()]
            stack.extend((v, p, copy, k) for v, p, k in reversed(children))
        elif isinstance(value, list):
            copy = [None] * len(value)
            stack.extend((v, f"{path}[{i}]", copy, i) for i, v in reversed(list(enumerate(value))))
        if parent is None:
            out.body = copy
        else:
            parent[slot] = copy
    return out


def body_digest(raw: bytes) -> dict[str, Any]:
    """A body named without its text: its size and digest."""
    return {"body": None, "body_bytes": len(raw), "body_sha256": hashlib.sha256(raw).hexdigest()}


def to_line(record: dict[str, Any]) -> bytes:
    """One log line: ASCII JSON (escapes for everything else, a lone surrogate included) and a newline."""
    return (json.dumps(record, ensure_ascii=True, separators=(",", ":")) + "\n").encode("ascii")


def refused_line(record: dict[str, Any], body: Any, raw: bytes | None) -> bytes:
    """A refused request's line: `record` with its body capped (strings to `REFUSED_FIELD_CHARS`), or named
    by the raw body's size and digest where even that passes `MAX_REFUSED_LINE_BYTES` or the body could not
    be read back (None with `raw`)."""
    capped = cap_strings(body, REFUSED_FIELD_CHARS, _REFUSED_MAX_VALUES, _REFUSED_MAX_DEPTH)
    if capped is not None and (body is not None or raw is None):
        line = to_line({**record, **with_cut(capped)})
        if len(line) <= MAX_REFUSED_LINE_BYTES:
            return line
    return to_line({**record, **(body_digest(raw) if raw is not None else {"body": None})})


def with_cut(capped: CappedBody) -> dict[str, Any]:
    """A line's "body" field, and its "capped" list when a string was cut."""
    fields: dict[str, Any] = {"body": capped.body}
    if capped.cut:
        fields["capped"] = [cut.to_json() for cut in capped.cut]
    return fields
