"""An XML tool call's arguments while the model writes them (Qwen3.5, Qwen3-Coder), as JSON in pieces.

The block body is `<function=NAME>` then `<parameter=KEY>\nVALUE\n</parameter>` per argument, then
`</function>`. The call opens once its `<function=NAME>` header is whole; each parameter streams as one
piece of the arguments JSON when it completes (`{"k": v`, then `, "k2": v2`), and the object closes at
`</function>` or where the block ends. As in vLLM's `qwen3_coder` format, one newline on either side of a
value is layout, a parameter without `</parameter>` ends at the next `<parameter=` or `</function>`, and
text between parameters is ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from swarmkv.api.tool_formats import typed_value

PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"
FUNCTION_CLOSE = "</function>"

_HEADER = re.compile(r"\s*<function=([^>\n]+)>")


def _layout_trimmed(value: str) -> str:
    """The value without the one newline the format puts on each side of it."""
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


class XmlCallStream:
    """The arguments of one XML call, scanned as the block's body grows."""

    def __init__(self, name: str, start: int, properties: Mapping[str, Any]) -> None:
        self.name = name
        self._pos = start  # offset in the body of the first character not yet consumed
        self._properties = properties  # the tool's property schemas, for typing values
        self._num_params = 0
        self.closed = False  # `</function>` seen, the arguments object closed
        self.text = ""  # the arguments text sent so far

    @staticmethod
    def open(body: str, properties_of: Mapping[str, Mapping[str, Any]]) -> XmlCallStream | None:
        """A stream for a body that starts with a complete `<function=NAME>`, else None."""
        match = _HEADER.match(body)
        if match is None or not match.group(1).strip():
            return None
        name = match.group(1).strip()
        return XmlCallStream(name, match.end(), properties_of.get(name, {}))

    def advance(self, body: str) -> str:
        """The arguments text the completed parameters of `body` (the block's body so far) add."""
        return self._scan(body, final=False)

    def finish(self, body: str) -> str:
        """At the block's end: the last parameter even without its closing tag, and the object's close."""
        return self._scan(body, final=True)

    def _scan(self, body: str, final: bool) -> str:
        piece = ""
        while not self.closed:
            step = self._next(body, final)
            if step is None:
                break
            piece += step
        if final and not self.closed:
            piece += self._close()
        self.text += piece
        return piece

    def _next(self, body: str, final: bool) -> str | None:
        """The text of the next complete parameter or the object's close; None until more text decides."""
        i = self._pos
        while i < len(body) and body[i].isspace():
            i += 1
        if body.startswith(FUNCTION_CLOSE, i):
            self._pos = i + len(FUNCTION_CLOSE)
            return self._close()
        start = body.find(PARAM_OPEN, i)
        if start < 0:
            return None
        key_end = body.find(">", start + len(PARAM_OPEN))
        if key_end < 0:
            return None
        key = body[start + len(PARAM_OPEN) : key_end].strip()
        value_start = key_end + 1
        ends = [(body.find(tag, value_start), tag) for tag in (PARAM_CLOSE, PARAM_OPEN, FUNCTION_CLOSE)]
        found = [(at, tag) for at, tag in ends if at >= 0]
        if not found:
            if not final:
                return None
            at, tag = len(body), ""
        else:
            at, tag = min(found)
        self._pos = at + len(tag) if tag == PARAM_CLOSE else at
        value = typed_value(_layout_trimmed(body[value_start:at]), self._properties.get(key))
        entry = f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"
        self._num_params += 1
        return ("{" if self._num_params == 1 else ", ") + entry

    def _close(self) -> str:
        self.closed = True
        return "}" if self._num_params else "{}"
