"""POST /v1/chat/completions: validate, render, submit, then stream chunks or answer one chat.completion."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmkv.api.chat_request import CHAT_ARRAYS, ChatRequest, parse_chat_request
from swarmkv.api.completions_objects import Envelope, finish_reason, sse, tool_call_delta, usage
from swarmkv.api.errors import APIError
from swarmkv.api.outputs import StepOutput
from swarmkv.api.paths import CHAT_ROUTE
from swarmkv.api.reasoning import ReasoningSplitter
from swarmkv.api.tool_formats import ToolFormat
from swarmkv.api.tool_parser import ToolCall
from swarmkv.breaks.causes import Break
from swarmkv.server.context import request_context
from swarmkv.server.engine_loop.request_stream import EngineUnavailableError, RequestStream
from swarmkv.server.http.disconnect import STATUS_CLIENT_GONE
from swarmkv.server.http.event_stream import EventStream
from swarmkv.server.observability.cache_breaks import with_diagnostics
from swarmkv.server.observability.latency import Latency
from swarmkv.server.pipeline.chat_stream import ToolNote, chat_deltas, parse_whole_reply
from swarmkv.server.pipeline.generate import collect_unless_disconnected, request_session_id, start_chat


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions."""
    arrival_s = time.perf_counter()
    ctx = request_context(request)
    payload = await ctx.read_body(request, CHAT_ARRAYS)
    req = parse_chat_request(payload)
    ctx.check_model(req.options.model)
    session_id = request_session_id(request, req.options.session_id, req.options.prompt_cache_key)
    started = await start_chat(ctx, req, session_id, arrival_s, "chatcmpl")
    # Logged once it runs: a refused request is logged as refused instead (`http/errors.py`), once.
    await ctx.log_request(CHAT_ROUTE, session_id, payload, started.rendered.text, started.stream.request_id)
    req, stream, found, reasoning = started.req, started.stream, started.found, started.reasoning
    env = Envelope(stream.request_id, int(time.time()), ctx.reply_model(req.options.model))
    latency = Latency(ctx.metrics, arrival_s)
    fmt = req.tool_format
    if req.options.stream:
        events = _chat_events(env, req, stream, latency, found, fmt, reasoning, started.note_tool)
        return EventStream(events, lambda: ctx.engine.abort(stream.request_id))
    outputs = await collect_unless_disconnected(request, ctx, stream, latency)
    if outputs is None:
        return Response(status_code=STATUS_CLIENT_GONE)
    last = outputs[-1] if outputs else None
    parsed = parse_whole_reply(req, outputs, fmt, reasoning, started.note_tool)
    content = parsed.content if parsed.content or not parsed.tool_calls else None
    reason = finish_reason(last, len(parsed.tool_calls))
    totals = with_diagnostics(usage(last), await found) if req.diagnostics else usage(last)
    return JSONResponse(env.chat_completion(content, parsed.tool_calls, reason, totals, parsed.reasoning))


async def _chat_events(
    env: Envelope,
    req: ChatRequest,
    stream: RequestStream,
    latency: Latency,
    found: Awaitable[Break | None],
    fmt: ToolFormat,
    reasoning: ReasoningSplitter | None,
    note: ToolNote,
) -> AsyncIterator[str]:
    # Diagnostics travel in the usage chunk, so asking for them asks for that chunk too.
    with_usage = req.options.include_usage or req.diagnostics
    yield sse(env.chat_chunk({"role": "assistant", "content": ""}, with_usage_field=with_usage))
    calls: list[ToolCall] = []
    last: StepOutput | None = None
    try:
        async for out, parsed in chat_deltas(req, stream, latency, fmt, reasoning, note):
            last = out
            if parsed.reasoning:
                yield sse(
                    env.chat_chunk({"reasoning_content": parsed.reasoning}, with_usage_field=with_usage)
                )
            if parsed.content:
                yield sse(env.chat_chunk({"content": parsed.content}, with_usage_field=with_usage))
            for piece in parsed.pieces:
                yield sse(env.chat_chunk(tool_call_delta(piece), with_usage_field=with_usage))
            calls += parsed.tool_calls
    except EngineUnavailableError as exc:
        yield sse(APIError(exc.status, str(exc), error_type="server_error").to_json())
        yield sse("[DONE]")
        return
    yield sse(env.chat_chunk({}, finish_reason(last, len(calls)), with_usage_field=with_usage))
    if with_usage:
        totals = with_diagnostics(usage(last), await found) if req.diagnostics else usage(last)
        yield sse(env.usage_chunk("chat.completion.chunk", totals))
    yield sse("[DONE]")
