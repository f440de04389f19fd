"""A streamed reply's output items as Responses API events: a reasoning item whose text arrives in
`response.reasoning_text.delta`s (and `response.reasoning_summary_text.delta`s when a summary is asked for),
message items whose text arrives in deltas, and function_call items whose arguments arrive in pieces as the
model writes them."""

from __future__ import annotations

from collections.abc import Iterator

from swarmkv.api.responses_objects import (
    EventWriter,
    function_call_item,
    message_item,
    new_id,
    reasoning_item,
    reasoning_part,
    summary_part,
    text_part,
)
from swarmkv.api.responses_request import Item
from swarmkv.api.tool_parser import ParsedDelta, ToolCall, in_writing_order


class OutputItems:
    """The items of one streamed response; a call open when a delta arrives ends before that delta's text,
    and the reasoning, which comes before all of a reply's text and calls, ends when they begin."""

    def __init__(
        self, emit: EventWriter, namespaces: dict[str, str] | None = None, summary: bool = False
    ) -> None:
        self._emit = emit
        self._namespaces = namespaces or {}  # function name -> the namespace tool it was offered from
        self._summary = summary  # whether the reasoning is also sent as the reasoning item's summary
        self.output: list[Item] = []  # the finished items
        self._reasoning: str | None = None  # the open reasoning item's text, None when none is open
        self._reasoning_id = ""
        self._text: str | None = None  # the open message's text, None when no message is open
        self._msg_id = ""
        self._call: tuple[str, str, str] | None = None  # the open call's item id, name and arguments so far
        self.num_calls = 0

    def add(self, parsed: ParsedDelta) -> Iterator[str]:
        """The events for one parsed delta."""
        yield from self._add_reasoning(parsed.reasoning)
        if parsed.content or parsed.pieces or parsed.tool_calls:
            yield from self._close_reasoning()
        yield from in_writing_order(parsed, self._call is not None, self._add_text, self._calls)

    def close(self) -> Iterator[str]:
        """End the reply's open reasoning item or message item."""
        yield from self._close_reasoning()
        yield from self.close_text()

    def _add_reasoning(self, reasoning: str) -> Iterator[str]:
        if not reasoning:
            return
        index = len(self.output)
        content = {"output_index": index, "content_index": 0}
        summary = {"output_index": index, "summary_index": 0}
        if self._reasoning is None:
            self._reasoning_id, self._reasoning = new_id("rs"), ""
            opening = reasoning_item(self._reasoning_id, "", self._summary, "in_progress")
            yield self._emit("response.output_item.added", {"output_index": index, "item": opening})
            where = {"item_id": self._reasoning_id, **content}
            yield self._emit("response.content_part.added", {**where, "part": reasoning_part("")})
            if self._summary:
                where = {"item_id": self._reasoning_id, **summary}
                yield self._emit("response.reasoning_summary_part.added", {**where, "part": summary_part("")})
        self._reasoning += reasoning
        item_id = self._reasoning_id
        yield self._emit("response.reasoning_text.delta", {"item_id": item_id, **content, "delta": reasoning})
        if self._summary:
            yield self._emit(
                "response.reasoning_summary_text.delta", {"item_id": item_id, **summary, "delta": reasoning}
            )

    def _close_reasoning(self) -> Iterator[str]:
        if self._reasoning is None:
            return
        text, index, item_id = self._reasoning, len(self.output), self._reasoning_id
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        yield self._emit("response.reasoning_text.done", {**where, "text": text})
        yield self._emit("response.content_part.done", {**where, "part": reasoning_part(text)})
        if self._summary:
            where = {"item_id": item_id, "output_index": index, "summary_index": 0}
            yield self._emit("response.reasoning_summary_text.done", {**where, "text": text})
            yield self._emit("response.reasoning_summary_part.done", {**where, "part": summary_part(text)})
        item = reasoning_item(item_id, text, self._summary)
        yield self._emit("response.output_item.done", {"output_index": index, "item": item})
        self.output.append(item)
        self._reasoning = None

    def close_text(self) -> Iterator[str]:
        """End an open message item."""
        if self._text is None:
            return
        text, index = self._text, len(self.output)
        where = {"item_id": self._msg_id, "output_index": index, "content_index": 0}
        yield self._emit("response.output_text.done", {**where, "text": text, "logprobs": []})
        yield self._emit("response.content_part.done", {**where, "part": text_part(text)})
        item = message_item(self._msg_id, text)
        yield self._emit("response.output_item.done", {"output_index": index, "item": item})
        self.output.append(item)
        self._text = None

    def _add_text(self, content: str) -> Iterator[str]:
        if not content:
            return
        where = {"item_id": self._msg_id, "output_index": len(self.output), "content_index": 0}
        if self._text is None:
            self._msg_id, self._text = new_id("msg"), ""
            where["item_id"] = self._msg_id
            opening = message_item(self._msg_id, "", "in_progress")
            yield self._emit(
                "response.output_item.added", {"output_index": len(self.output), "item": opening}
            )
            yield self._emit("response.content_part.added", {**where, "part": text_part("")})
        self._text += content
        yield self._emit("response.output_text.delta", {**where, "delta": content, "logprobs": []})

    def _calls(self, parsed: ParsedDelta) -> Iterator[str]:
        for piece in parsed.pieces:
            if piece.name is not None:
                yield from self.close_text()
                self._call = (new_id("fc"), piece.name, "")
                opening = function_call_item(
                    self._call[0],
                    ToolCall(piece.id, piece.name, ""),
                    "in_progress",
                    self._namespaces.get(piece.name),
                )
                yield self._emit(
                    "response.output_item.added", {"output_index": len(self.output), "item": opening}
                )
            assert self._call is not None, "a call's pieces follow its first"
            if piece.arguments:
                item_id, name, arguments = self._call
                self._call = (item_id, name, arguments + piece.arguments)
                where = {"item_id": item_id, "output_index": len(self.output)}
                yield self._emit(
                    "response.function_call_arguments.delta", {**where, "delta": piece.arguments}
                )
        for call in parsed.tool_calls:
            assert self._call is not None, "a call ends after its pieces"
            item_id = self._call[0]
            where = {"item_id": item_id, "output_index": len(self.output)}
            done = {**where, "name": call.name, "arguments": call.arguments}
            yield self._emit("response.function_call_arguments.done", done)
            item = function_call_item(item_id, call, namespace=self._namespaces.get(call.name))
            yield self._emit("response.output_item.done", {"output_index": len(self.output), "item": item})
            self.output.append(item)
            self._call = None
            self.num_calls += 1
