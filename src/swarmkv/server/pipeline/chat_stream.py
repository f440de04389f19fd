"""A chat reply's outputs as content and tool calls: piece by piece while it streams, or whole once it finished.

Chat completions, Messages and Responses all read a reply through these two, so the three protocols parse
the same text into the same calls, in the tool-call format the model's chat template asks for (`fmt`, the
request's `tool_format`: a forced call's opening is read in it). A caller that
passes a `ReasoningSplitter` also gets a thinking model's `<think>` reasoning apart from the content; the
split comes first, so a call written while reasoning is not a call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from swarmkv.api.chat_request import ChatRequest
from swarmkv.api.outputs import StepOutput
from swarmkv.api.reasoning import ReasoningSplit, ReasoningSplitter
from swarmkv.api.tool_formats import ToolFormat
from swarmkv.api.tool_parser import ParsedDelta, StreamingToolParser, ToolCall, parse_tool_calls
from swarmkv.server.engine_loop.request_stream import RequestStream
from swarmkv.server.observability.latency import Latency

# Told a finished reply's tool calls (`StartedChat.note_tool`: the engine forecasts the session's pause from them).
ToolNote = Callable[[Sequence[ToolCall]], None]


def parse_whole_reply(
    req: ChatRequest,
    outputs: list[StepOutput],
    fmt: ToolFormat,
    reasoning: ReasoningSplitter | None = None,
    note: ToolNote | None = None,
) -> ParsedDelta:
    """A finished reply's reasoning (when split), text and tool calls (told to `note`)."""
    split = ReasoningSplit(content="".join(o.text for o in outputs))
    if reasoning is not None:
        split = ReasoningSplit()
        for out in outputs:  # output by output, so the splitter counts the reasoning's tokens
            split = split.then(reasoning.feed(out.text, out.num_new_tokens, out.token_text_ends))
        split = split.then(reasoning.finish())
    if not req.parses_tool_calls:
        return ParsedDelta(content=split.content, reasoning=split.reasoning)
    parsed = parse_tool_calls(req.forced_call_opening() + split.content, fmt=fmt, tools=req.callable_tools)
    if note is not None:
        note(parsed.tool_calls)
    return ParsedDelta(reasoning=split.reasoning).then(parsed)


async def chat_deltas(
    req: ChatRequest,
    stream: RequestStream,
    latency: Latency,
    fmt: ToolFormat,
    reasoning: ReasoningSplitter | None = None,
    note: ToolNote | None = None,
) -> AsyncIterator[tuple[StepOutput, ParsedDelta]]:
    """Each engine output with the reasoning (when split), content and complete tool calls it added (all of
    them told to `note` once the reply finished)."""
    calls: list[ToolCall] = []
    parser = StreamingToolParser(fmt=fmt, tools=req.callable_tools) if req.parses_tool_calls else None
    # A forced call's prefix opens its block and may open the call itself: that goes out with the first output.
    opening = parser.feed(req.forced_call_opening()) if parser is not None else ParsedDelta()
    async for out in stream:
        latency.observe(out)
        split = ReasoningSplit(content=out.text)
        if reasoning is not None:
            split = reasoning.feed(out.text, out.num_new_tokens, out.token_text_ends)
            if out.finished:
                split = split.then(reasoning.finish())
        parsed = ParsedDelta(reasoning=split.reasoning)
        if parser is None:
            parsed = parsed.then(ParsedDelta(content=split.content))
        else:
            parsed = parsed.then(opening).then(parser.feed(split.content))
            if out.finished:
                parsed = parsed.then(parser.finish())
        opening = ParsedDelta()
        calls += parsed.tool_calls
        if out.finished and note is not None and req.parses_tool_calls:
            note(calls)
        yield out, parsed
