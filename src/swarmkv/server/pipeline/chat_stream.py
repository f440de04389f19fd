"""A chat reply's outputs as content and tool calls: piece by piece while it streams, or whole once it finished.

Chat completions, Messages and Responses all read a reply through these two, so the three protocols parse
the same text into the same calls, in the tool-call format the model's chat template asks for.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from swarmkv.api.chat_request import ChatRequest
from swarmkv.api.outputs import StepOutput
from swarmkv.api.tool_formats import ToolFormat
from swarmkv.api.tool_parser import ParsedDelta, StreamingToolParser, parse_tool_calls
from swarmkv.server.engine_loop.request_stream import RequestStream
from swarmkv.server.observability.latency import Latency


def parse_whole_reply(req: ChatRequest, outputs: list[StepOutput], fmt: ToolFormat) -> ParsedDelta:
    """A finished reply's text and tool calls."""
    body = "".join(o.text for o in outputs)
    if not req.parses_tool_calls:
        return ParsedDelta(content=body)
    return parse_tool_calls(req.forced_prefix() + body, fmt=fmt, tools=req.prompt_tools)


async def chat_deltas(
    req: ChatRequest, stream: RequestStream, latency: Latency, fmt: ToolFormat
) -> AsyncIterator[tuple[StepOutput, ParsedDelta]]:
    """Each engine output with the content and complete tool calls it added."""
    parser = StreamingToolParser(fmt=fmt, tools=req.prompt_tools) if req.parses_tool_calls else None
    # A forced call's prefix opens its block and may open the call itself: that goes out with the first output.
    opening = parser.feed(req.forced_prefix()) if parser is not None else ParsedDelta()
    async for out in stream:
        latency.observe(out)
        parsed = ParsedDelta(content=out.text) if parser is None else opening.then(parser.feed(out.text))
        opening = ParsedDelta()
        if parser is not None and out.finished:
            parsed = parsed.then(parser.finish())
        yield out, parsed
