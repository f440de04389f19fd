"""POST /v1/chat/completions and /v1/completions: validate, template, submit, then stream or collect."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from swarmkv.breaks.causes import Break, RenderedPrompt
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.errors import InvalidRequestError
from swarmkv.server.cache_breaks import with_diagnostics
from swarmkv.server.chat_request import ChatRequest, parse_chat_request
from swarmkv.server.context import ServerContext
from swarmkv.server.disconnect import STATUS_CLIENT_GONE, ClientDisconnected, unless_disconnected
from swarmkv.server.metrics import ServerMetrics
from swarmkv.server.protocol import (
    SESSION_HEADER,
    APIError,
    Options,
    bad_request,
    parse_completion_request,
    resolve_session_id,
)
from swarmkv.server.request_stream import EngineUnavailableError, RequestStream, StepOutput
from swarmkv.server.responses import Envelope, sse, tool_call_delta, usage
from swarmkv.server.tool_parser import ParsedDelta, StreamingToolParser, ToolCall, parse_tool_calls
from swarmkv.tokenizer import Tokenizer

CHAT_ROUTE = "/v1/chat/completions"
COMPLETIONS_ROUTE = "/v1/completions"


class Latency:
    """Observes time to first token and inter-token latency of one request as its outputs arrive."""

    def __init__(self, metrics: ServerMetrics, arrival_s: float) -> None:
        self._metrics = metrics
        self._last_s: float | None = None
        self._arrival_s = arrival_s

    def observe(self, out: StepOutput) -> None:
        if out.num_new_tokens == 0:
            return
        if self._last_s is None:
            self._metrics.time_to_first_token.observe(out.emitted_at_s - self._arrival_s)
        else:
            self._metrics.inter_token_latency.observe(out.emitted_at_s - self._last_s)
        self._last_s = out.emitted_at_s


def _usage(out: StepOutput | None) -> dict[str, int | dict[str, int]]:
    if out is None:
        return usage(0, 0, 0)
    return usage(out.num_prompt_tokens, out.num_output_tokens, out.num_cached_tokens)


def _finish_reason(out: StepOutput | None, num_calls: int) -> str | None:
    reason = out.finish_reason if out is not None else None
    return "tool_calls" if num_calls and reason == "stop" else reason


def _session_id(request: Request, options: Options) -> str | None:
    return resolve_session_id(options.session_id, request.headers.get(SESSION_HEADER))


async def _submit(
    ctx: ServerContext,
    prefix: str,
    prompt_ids: list[int],
    params: SamplingParams,
    options: Options,
    session_id: str | None,
    arrival_s: float,
) -> RequestStream:
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    try:
        return await ctx.engine.submit(
            request_id, prompt_ids, params, options.cache_salt, arrival_s, session_id=session_id
        )
    except InvalidRequestError as exc:
        raise bad_request(str(exc)) from exc


def render_chat(tokenizer: Tokenizer, req: ChatRequest) -> RenderedPrompt:
    """The chat prompt as the engine will see it: messages and tools through the chat template, then the
    forced prefix of a required tool call."""
    tools = req.tools if req.tool_choice.mode != "none" else None
    try:
        text = tokenizer.apply_chat_template(req.messages, tools=tools) + req.forced_prefix()
    except InvalidRequestError as exc:
        raise bad_request(str(exc), param="messages") from exc
    return RenderedPrompt(tokenizer.encode(text, add_special_tokens=False), text, req.messages, tools)


async def start_chat(
    ctx: ServerContext, req: ChatRequest, session_id: str | None, arrival_s: float, id_prefix: str
) -> tuple[RequestStream, RenderedPrompt, Awaitable[Break | None]]:
    """Render and submit a chat request; its stream, its prompt, and the cache break it causes (if any)."""
    rendered = render_chat(ctx.tokenizer, req)
    params = req.options.sampling_params(
        len(rendered.token_ids), ctx.max_model_len, "messages", req.forced_stop()
    )
    stream = await _submit(ctx, id_prefix, rendered.token_ids, params, req.options, session_id, arrival_s)
    return stream, rendered, ctx.breaks.watch(session_id, req.options.cache_salt, rendered)


def parse_whole_reply(req: ChatRequest, outputs: list[StepOutput]) -> ParsedDelta:
    """A finished reply's text and tool calls."""
    body = "".join(o.text for o in outputs)
    return (
        parse_tool_calls(req.forced_prefix() + body) if req.parses_tool_calls else ParsedDelta(content=body)
    )


async def chat_deltas(
    req: ChatRequest, stream: RequestStream, latency: Latency
) -> AsyncIterator[tuple[StepOutput, ParsedDelta]]:
    """Each engine output with the content and complete tool calls it added."""
    parser = StreamingToolParser() if req.parses_tool_calls else None
    # A forced call's prefix opens its block and may open the call itself: that goes out with the first output.
    opening = parser.feed(req.forced_prefix()) if parser is not None else ParsedDelta()
    async for out in stream:
        latency.observe(out)
        parsed = ParsedDelta(content=out.text) if parser is None else opening.then(parser.feed(out.text))
        opening = ParsedDelta()
        if parser is not None and out.finished:
            parsed = parsed.then(parser.finish())
        yield out, parsed


async def chat_completions(request: Request) -> Response:
    """POST /v1/chat/completions."""
    arrival_s = time.perf_counter()
    ctx: ServerContext = request.app.state.ctx
    payload = await ctx.read_body(request)
    req = parse_chat_request(payload)
    ctx.check_model(req.options.model)
    session_id = _session_id(request, req.options)
    ctx.log_request(CHAT_ROUTE, session_id, payload)
    stream, _, found = await start_chat(ctx, req, session_id, arrival_s, "chatcmpl")
    env = Envelope(stream.request_id, int(time.time()), ctx.model_name)
    latency = Latency(ctx.metrics, arrival_s)
    if req.options.stream:
        return EventStream(
            _chat_events(env, req, stream, latency, found), lambda: ctx.engine.abort(stream.request_id)
        )
    outputs = await collect_unless_disconnected(request, ctx, stream, latency)
    if outputs is None:
        return Response(status_code=STATUS_CLIENT_GONE)
    last = outputs[-1] if outputs else None
    parsed = parse_whole_reply(req, outputs)
    content = parsed.content if parsed.content or not parsed.tool_calls else None
    reason = _finish_reason(last, len(parsed.tool_calls))
    totals = with_diagnostics(_usage(last), await found) if req.diagnostics else _usage(last)
    return JSONResponse(env.chat_completion(content, parsed.tool_calls, reason, totals))


async def _chat_events(
    env: Envelope, req: ChatRequest, stream: RequestStream, latency: Latency, found: Awaitable[Break | None]
) -> AsyncIterator[str]:
    # Diagnostics travel in the usage chunk, so asking for them asks for that chunk too.
    with_usage = req.options.include_usage or req.diagnostics
    yield sse(env.chat_chunk({"role": "assistant", "content": ""}, with_usage_field=with_usage))
    calls: list[ToolCall] = []
    last: StepOutput | None = None
    try:
        async for out, parsed in chat_deltas(req, stream, latency):
            last = out
            if parsed.content:
                yield sse(env.chat_chunk({"content": parsed.content}, with_usage_field=with_usage))
            for piece in parsed.pieces:
                yield sse(env.chat_chunk(tool_call_delta(piece), with_usage_field=with_usage))
            calls += parsed.tool_calls
    except EngineUnavailableError as exc:
        yield sse(APIError(exc.status, str(exc), error_type="server_error").to_json())
        yield sse("[DONE]")
        return
    yield sse(env.chat_chunk({}, _finish_reason(last, len(calls)), with_usage_field=with_usage))
    if with_usage:
        totals = with_diagnostics(_usage(last), await found) if req.diagnostics else _usage(last)
        yield sse(env.usage_chunk("chat.completion.chunk", totals))
    yield sse("[DONE]")


async def completions(request: Request) -> Response:
    """POST /v1/completions."""
    arrival_s = time.perf_counter()
    ctx: ServerContext = request.app.state.ctx
    body = await ctx.read_body(request)
    req = parse_completion_request(body)
    ctx.check_model(req.options.model)
    session_id = _session_id(request, req.options)
    ctx.log_request(COMPLETIONS_ROUTE, session_id, body)
    if isinstance(req.prompt, str):
        prompt_ids = ctx.tokenizer.encode(req.prompt, add_special_tokens=True)
    else:
        prompt_ids = req.prompt
    params = req.options.sampling_params(len(prompt_ids), ctx.max_model_len, "prompt")
    stream = await _submit(ctx, "cmpl", prompt_ids, params, req.options, session_id, arrival_s)
    env = Envelope(stream.request_id, int(time.time()), ctx.model_name)
    latency = Latency(ctx.metrics, arrival_s)
    if req.options.stream:
        events = _completion_events(env, req.options.include_usage, stream, latency)
        return EventStream(events, lambda: ctx.engine.abort(stream.request_id))
    outputs = await collect_unless_disconnected(request, ctx, stream, latency)
    if outputs is None:
        return Response(status_code=STATUS_CLIENT_GONE)
    last = outputs[-1] if outputs else None
    text = "".join(o.text for o in outputs)
    return JSONResponse(env.completion(text, _finish_reason(last, 0), _usage(last)))


async def _completion_events(
    env: Envelope, with_usage: bool, stream: RequestStream, latency: Latency
) -> AsyncIterator[str]:
    last: StepOutput | None = None
    try:
        async for out in stream:
            latency.observe(out)
            last = out
            if out.text:
                yield sse(env.completion_chunk(out.text, with_usage_field=with_usage))
    except EngineUnavailableError as exc:
        yield sse(APIError(exc.status, str(exc), error_type="server_error").to_json())
        yield sse("[DONE]")
        return
    yield sse(env.completion_chunk("", _finish_reason(last, 0), with_usage_field=with_usage))
    if with_usage:
        yield sse(env.usage_chunk("text_completion", _usage(last)))
    yield sse("[DONE]")


async def collect_unless_disconnected(
    request: Request, ctx: ServerContext, stream: RequestStream, latency: Latency
) -> list[StepOutput] | None:
    """Every output of a non-streamed request; None (and the request aborted) if the client disconnects first."""

    async def collect() -> list[StepOutput]:
        outputs = []
        async for out in stream:
            latency.observe(out)
            outputs.append(out)
        return outputs

    try:
        return await unless_disconnected(request, collect())
    except ClientDisconnected:
        ctx.engine.abort(stream.request_id)
        return None


class EventStream(StreamingResponse):
    """Server-sent events that abort their request however the response ends (done, error, disconnect)."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
