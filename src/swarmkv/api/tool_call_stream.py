"""A tool call's arguments while the model is still writing them: the call's header, then the JSON in pieces.

A block opened by `<tool_call>` becomes a call as soon as its body starts with a complete header,
`{"name": "<name>", "arguments": {` (whitespace anywhere JSON allows it). From then on the arguments
object's text streams as the model writes it, character for character, until the object closes: the
scanner follows strings, escapes and nesting, so nothing after the object (the call's own closing brace)
is sent as arguments. Clients concatenate the pieces and parse them at the end, as they do OpenAI's and
Anthropic's fragmented arguments. A block without such a header (a name with escapes, arguments given as a
string) is decided whole when it closes, as before.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

# Small models often close the arguments object but forget the outer one: up to this many missing
# closing braces are supplied, never any other character.
MAX_MISSING_BRACES = 2

_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]+)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')


@dataclass(frozen=True)
class CallPiece:
    """One streamed piece of a call: its first piece carries the name, every piece some argument text."""

    index: int  # the call's position among the reply's calls
    id: str
    name: str | None  # set on the first piece only
    arguments: str


class ArgumentStream:
    """The arguments of one committed call, scanned as the block's body grows."""

    def __init__(self, name: str, start: int) -> None:
        self.name = name
        self._start = start  # offset in the block's body where the arguments object opens
        self._scanned = start
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self.closed = False  # the arguments object has closed
        self.text = ""  # the arguments text sent so far

    @staticmethod
    def open(body: str) -> ArgumentStream | None:
        """A stream for a body that starts with a complete call header, else None."""
        match = _HEADER.match(body)
        return ArgumentStream(match.group(1), match.end()) if match else None

    def advance(self, body: str) -> str:
        """The arguments text that `body` (the block's body so far) adds; nothing past the object's end."""
        begin = self._scanned
        end = len(body)
        i = begin
        while i < end and not self.closed:
            ch = body[i]
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                self.closed = self._depth == 0
            i += 1
        self._scanned = i
        piece = body[begin:i]
        self.text += piece
        return piece

    def completion(self) -> str:
        """What the sent text lacks to be JSON: the closing braces a small model forgot, if that is all."""
        for braces in range(MAX_MISSING_BRACES + 1):
            try:
                json.loads(self.text + "}" * braces)
            except ValueError:
                continue
            return "}" * braces
        return ""
