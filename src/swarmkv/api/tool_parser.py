"""Tool calls in model text -> OpenAI calls: Hermes JSON or the XML form, inside `<tool_call>` blocks.

The parser is incremental so that streamed chat completions and whole ones parse identically: a whole
reply is one `feed()` followed by `finish()`. Text outside the tags is the message content; text that
might still become a tag (a trailing "<tool_" while streaming) is held back until the next piece decides.
Whitespace just before a tool call, or trailing a reply that made calls, is dropped, so a reply made only
of calls has no content, as OpenAI's replies do (a reply without calls keeps every character).

A block is a call once its body starts with a whole header, `{"name": ..., "arguments": {`; its arguments
then stream in pieces (`tool_call_stream.py`), and they stay its arguments even if they never parse. A block
without that header is decided when it closes: one whose body is not a JSON object with a string `name`
(after supplying up to MAX_MISSING_BRACES closing braces) stays in the content verbatim, so nothing the
model wrote is lost.

With the XML format (`tool_formats.py`, chosen from the chat template) a block whose body starts with a whole
`<function=NAME>` is a call whose parameters stream as JSON as each completes (`xml_call_stream.py`); a JSON
body is still read as Hermes, as a forced call's opening is written in that form.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from swarmkv.api.tool_call_stream import MAX_MISSING_BRACES, ArgumentStream, CallPiece
from swarmkv.api.tool_formats import ToolFormat, parameter_schemas
from swarmkv.api.xml_call_stream import XmlCallStream

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is JSON text, as OpenAI's `function.arguments` is."""

    id: str
    name: str
    arguments: str

    def to_openai(self) -> dict[str, Any]:
        """The call as an entry of OpenAI's `tool_calls` list."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ParsedDelta:
    """What one piece of model text added: message content, complete tool calls, and the pieces of calls
    as they stream (every call in `tool_calls` had its pieces, in this delta or earlier ones); and, where
    the reply's reasoning is split out (`reasoning.py`), the reasoning text, which precedes all of those."""

    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    pieces: list[CallPiece] = field(default_factory=list)
    reasoning: str = ""

    def then(self, later: ParsedDelta) -> ParsedDelta:
        """This delta followed by `later`, as one."""
        return ParsedDelta(
            self.content + later.content,
            self.tool_calls + later.tool_calls,
            self.pieces + later.pieces,
            self.reasoning + later.reasoning,
        )


def in_writing_order(
    parsed: ParsedDelta,
    call_open: bool,
    text: Callable[[str], Iterator[str]],
    calls: Callable[[ParsedDelta], Iterator[str]],
) -> Iterator[str]:
    """A streaming writer's events for one delta, in the order the model wrote it: a call open when the delta
    arrives ends before the delta's text; otherwise the text comes before the calls the delta opens."""
    if call_open:
        yield from calls(parsed)
        yield from text(parsed.content)
    else:
        yield from text(parsed.content)
        yield from calls(parsed)


def new_call_id() -> str:
    """A fresh OpenAI-style tool call id."""
    return f"call_{uuid.uuid4().hex[:24]}"


def call_from_json(body: Any, call_id: str) -> ToolCall | None:
    """A ToolCall from a decoded block body, or None when it is not `{"name": str, "arguments": ...}`."""
    if not isinstance(body, dict) or not isinstance(body.get("name"), str) or not body["name"]:
        return None
    arguments = body.get("arguments", body.get("parameters", {}))
    if isinstance(arguments, str):
        # Some models write the arguments pre-encoded: keep them when they are JSON.
        try:
            json.loads(arguments)
        except ValueError:
            return None
        return ToolCall(call_id, body["name"], arguments)
    return ToolCall(call_id, body["name"], json.dumps(arguments, ensure_ascii=False))


def _decode(text: str, whole: bool) -> tuple[Any, str] | None:
    """The JSON value `text` starts with and what follows it (nothing when `whole`); None if there is none."""
    try:
        if whole:
            return json.loads(text), ""
        value, end = json.JSONDecoder().raw_decode(text)
        return value, text[end:]
    except ValueError:
        pass
    for braces in range(1, MAX_MISSING_BRACES + 1):
        try:
            return json.loads(text + "}" * braces), ""
        except ValueError:
            continue
    return None


def _parse_block(body: str, call_id: str, terminated: bool) -> tuple[ToolCall | None, str]:
    """The call in a block body and the text left after it (only an unterminated block may leave text).

    An unterminated block was cut off by a stop string or the end of generation: its first JSON value
    is the call and what follows is content.
    """
    decoded = _decode(body.strip(), whole=terminated)
    if decoded is None:
        return None, ""
    value, rest = decoded
    return call_from_json(value, call_id), rest


def _held_tag_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class StreamingToolParser:
    """Splits model text, piece by piece, into content and tool calls."""

    def __init__(
        self,
        new_id: Callable[[], str] = new_call_id,
        fmt: ToolFormat = "hermes",
        tools: list[dict[str, Any]] | None = None,
    ) -> None:
        self._new_id = new_id
        self._format = fmt
        self._schemas = parameter_schemas(tools)  # typing XML parameter values
        self._buffer = ""  # text not yet classified
        self._in_call = False  # whether `_buffer` is the body of an open <tool_call>
        self._pending_space = ""  # trailing whitespace of the content, held until more content follows
        # The open block's call, once its header is whole.
        self._call: tuple[str, ArgumentStream | XmlCallStream] | None = None
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        """Classify newly generated text; returns the content and calls it completes."""
        self._buffer += text
        out = ParsedDelta()
        while True:
            if self._in_call:
                end = self._buffer.find(CLOSE_TAG)
                if end < 0:
                    # Text that may begin the closing tag is not the body's until the next piece decides.
                    self._stream_body(
                        self._buffer[: len(self._buffer) - _held_tag_prefix(self._buffer, CLOSE_TAG)], out
                    )
                    return out
                body, self._buffer = self._buffer[:end], self._buffer[end + len(CLOSE_TAG) :]
                self._in_call = False
                self._close_block(body, True, out)
                continue
            start = self._buffer.find(OPEN_TAG)
            if start < 0:
                keep = _held_tag_prefix(self._buffer, OPEN_TAG)
                self._emit(self._buffer[: len(self._buffer) - keep], out)
                self._buffer = self._buffer[len(self._buffer) - keep :]
                return out
            self._emit(self._buffer[:start], out)
            self._buffer = self._buffer[start + len(OPEN_TAG) :]
            self._in_call = True

    def finish(self) -> ParsedDelta:
        """Flush at the end of generation: an open block still parses if its JSON is complete."""
        out = ParsedDelta()
        if self._in_call:
            self._in_call = False
            self._close_block(self._buffer, False, out)
        else:
            self._emit(self._buffer, out)
        self._buffer = ""
        if self._pending_space and self.num_calls == 0:
            out.content += self._pending_space
        self._pending_space = ""
        return out

    def _stream_body(self, body: str, out: ParsedDelta) -> None:
        """Open the block's call once its header is whole, and send the arguments text the body adds."""
        if self._call is None:
            stream = self._open_stream(body)
            if stream is None:
                return
            self._call = (self._new_id(), stream)
            out.pieces.append(CallPiece(self.num_calls, self._call[0], stream.name, ""))
        call_id, stream = self._call
        piece = stream.advance(body)
        if piece:
            out.pieces.append(CallPiece(self.num_calls, call_id, None, piece))

    def _open_stream(self, body: str) -> ArgumentStream | XmlCallStream | None:
        if self._format == "xml" and (xml := XmlCallStream.open(body, self._schemas)) is not None:
            return xml
        return ArgumentStream.open(body)

    def _close_block(self, body: str, terminated: bool, out: ParsedDelta) -> None:
        self._stream_body(body, out)
        opened, self._call = self._call, None
        if opened is not None and isinstance(xml := opened[1], XmlCallStream):
            if tail := xml.finish(body):
                out.pieces.append(CallPiece(self.num_calls, opened[0], None, tail))
            # Text after `</function>` inside the block is the format's layout, not content.
            self._commit(ToolCall(opened[0], xml.name, xml.text), "", out)
            return
        call, rest = _parse_block(body, opened[0] if opened else self._new_id(), terminated)
        if opened is not None:
            call_id, stream = opened
            assert isinstance(stream, ArgumentStream)
            if call is None:
                # The header made it a call: arguments that do not parse are still its arguments, as
                # OpenAI's models may write invalid JSON; nothing after them is content.
                call, rest = ToolCall(call_id, stream.name, stream.text), ""
            elif missing := stream.completion():
                out.pieces.append(CallPiece(self.num_calls, call_id, None, missing))
        elif call is not None:
            out.pieces.append(CallPiece(self.num_calls, call.id, call.name, call.arguments))
        if call is None:
            suffix = CLOSE_TAG if terminated else ""
            self._emit(OPEN_TAG + body + suffix, out)
            return
        self._commit(call, rest, out)

    def _commit(self, call: ToolCall, rest: str, out: ParsedDelta) -> None:
        out.tool_calls.append(call)
        self.num_calls += 1
        self._pending_space = ""  # whitespace right before a call is layout, not content
        self._emit(rest, out)

    def _emit(self, text: str, out: ParsedDelta) -> None:
        # Trailing whitespace waits: it becomes content only once more content follows it.
        body = text.rstrip()
        if body:
            out.content += self._pending_space + body
            self._pending_space = text[len(body) :]
        else:
            self._pending_space += text


def parse_tool_calls(
    text: str,
    new_id: Callable[[], str] = new_call_id,
    fmt: ToolFormat = "hermes",
    tools: list[dict[str, Any]] | None = None,
) -> ParsedDelta:
    """Parse a whole reply at once: its content and its tool calls."""
    parser = StreamingToolParser(new_id, fmt, tools)
    return parser.feed(text).then(parser.finish())
