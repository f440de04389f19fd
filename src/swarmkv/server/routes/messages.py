"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API over the chat pipeline.

The body becomes a chat request (`api/messages_request.py`), runs through the same renderer, engine, tool
parser and stream as a chat completion (`pipeline/`), and its outputs are dressed as Anthropic's message and
events (`api/messages_objects.py`).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmkv.api.errors import APIError
from swarmkv.api.layout import resolve_layout
from swarmkv.api.messages_objects import (
    CacheTokens,
    ContentBlocks,
    anthropic_error,
    anthropic_event,
    matched_stop,
    message_json,
    reply_content,
    stop_reason,
)
from swarmkv.api.messages_request import MESSAGES_ARRAYS, Breakpoint, MessagesRequest, parse_messages_request
from swarmkv.api.outputs import StepOutput
from swarmkv.api.paths import CHAT_ROUTE
from swarmkv.api.render import render_messages
from swarmkv.api.session_id import CLAUDE_CODE_SESSION_HEADER
from swarmkv.server.context import ServerContext, request_context
from swarmkv.server.engine_loop.commands import RequestPin
from swarmkv.server.engine_loop.request_stream import EngineUnavailableError
from swarmkv.server.http.disconnect import STATUS_CLIENT_GONE
from swarmkv.server.http.event_stream import EventStream
from swarmkv.server.observability.latency import Latency
from swarmkv.server.pipeline.chat_stream import chat_deltas, parse_whole_reply
from swarmkv.server.pipeline.generate import (
    StartedChat,
    collect_unless_disconnected,
    count_prompt,
    in_worker,
    prompt_encoder,
    request_session_id,
    start_rendered,
)
from swarmkv.server.routes.pins import engine_pin_id


async def messages(request: Request) -> Response:
    """POST /v1/messages."""
    arrival_s = time.perf_counter()
    ctx = request_context(request)
    payload = await ctx.read_body(request, MESSAGES_ARRAYS)
    req = parse_messages_request(payload)
    ctx.check_model(req.chat.options.model)
    session_id = request_session_id(request, req.user_id, client_header=CLAUDE_CODE_SESSION_HEADER)
    layout = resolve_layout(ctx.prompt_layout, "messages")
    encode = prompt_encoder(ctx, "messages")
    rendered = await in_worker(lambda: render_messages(ctx.tokenizer, req, layout, encode))
    pins = tuple(_pin(ctx, req, mark, ids) for mark, ids in zip(req.breakpoints, rendered.pins, strict=True))
    started = await start_rendered(ctx, rendered.req, rendered.prompt, session_id, arrival_s, "msg", pins)
    # Logged once it runs, as the chat request it runs as.
    await ctx.log_request(
        CHAT_ROUTE, session_id, req.chat_body, rendered.prompt.text, started.stream.request_id, "messages"
    )
    stream = started.stream
    # What the pins computed is cache creation; what a pin found cached (a moved mark's old prefix, or a
    # refreshed pin) is read, not created.
    num_pinned = stream.num_pin_created_tokens
    msg_id = f"msg_{stream.request_id.removeprefix('msg-')}"
    latency = Latency(ctx.metrics, arrival_s)
    if req.chat.options.stream:
        events = _events(ctx, started, latency, msg_id, num_pinned)
        return EventStream(events, lambda: ctx.engine.abort(stream.request_id))
    outputs = await collect_unless_disconnected(request, ctx, stream, latency)
    if outputs is None:
        return Response(status_code=STATUS_CLIENT_GONE)
    last = outputs[-1] if outputs else None
    chat = started.req
    parsed = parse_whole_reply(chat, outputs, chat.tool_format, started.reasoning, started.note_tool)
    usage = CacheTokens.of(last, num_pinned).usage(last.num_output_tokens if last else 0)
    reason = stop_reason(last, len(parsed.tool_calls))
    content = reply_content(parsed)
    body = message_json(
        msg_id, ctx.reply_model(req.chat.options.model), content, reason, usage, matched_stop(last, reason)
    )
    return JSONResponse(body)


async def count_tokens(request: Request) -> Response:
    """POST /v1/messages/count_tokens: the prompt's length as /v1/messages would render it, nothing generated."""
    ctx = request_context(request)
    req = parse_messages_request(await ctx.read_body(request, MESSAGES_ARRAYS), needs_max_tokens=False)
    ctx.check_model(req.chat.options.model)
    return JSONResponse({"input_tokens": await count_prompt(ctx, req.chat, "messages")})


def _pin(ctx: ServerContext, req: MessagesRequest, mark: Breakpoint, ids: list[int]) -> RequestPin:
    """A cache_control mark's pin, made with its request: under an id that follows from the prefix and salt,
    so a repeated or concurrent request shares its pin instead of adding one; within its tenant's share of the pinned
    memory where tenants share it."""
    salt = ctx.tenant.cache_salt(req.chat.options.cache_salt)
    digest = hashlib.sha256(f"{salt}\0{ids}".encode()).hexdigest()[:32]
    group = ctx.tenant.name
    share = (group, ctx.num_tenants) if group is not None and ctx.num_tenants > 1 else None
    return RequestPin(engine_pin_id(ctx, f"pin-msg-{digest}"), ids, mark.ttl_s, share)


async def _events(
    ctx: ServerContext, started: StartedChat, latency: Latency, msg_id: str, num_pinned: int
) -> AsyncIterator[str]:
    def message_start(first: StepOutput | None) -> str:
        # Sent with the first step's output, as Anthropic sends it after the prefill: by then the prompt's
        # split (read from the cache, pinned, computed) is known, and clients read it from here.
        usage = (
            CacheTokens.of(first, num_pinned).usage(0)
            if first
            else CacheTokens(len(started.rendered.token_ids), 0, 0).usage(0)
        )
        return anthropic_event(
            "message_start",
            {"message": message_json(msg_id, ctx.reply_model(started.req.options.model), [], None, usage)},
        )

    blocks = ContentBlocks()
    last: StepOutput | None = None
    chat = started.req
    try:
        async for out, parsed in chat_deltas(
            chat, started.stream, latency, chat.tool_format, started.reasoning, started.note_tool
        ):
            if last is None:
                yield message_start(out)
                yield anthropic_event("ping", {})
            last = out
            for event in blocks.add(parsed):
                yield event
    except EngineUnavailableError as exc:
        _, body = anthropic_error(APIError(exc.status, str(exc), error_type="server_error"))
        yield anthropic_event("error", {"error": body["error"]})
        return
    if last is None:
        yield message_start(None)
    for event in blocks.close():
        yield event
    usage = CacheTokens.of(last, num_pinned).usage(last.num_output_tokens if last else 0)
    reason = stop_reason(last, blocks.num_calls)
    end = {"stop_reason": reason, "stop_sequence": matched_stop(last, reason)}
    yield anthropic_event("message_delta", {"delta": end, "usage": usage})
    yield anthropic_event("message_stop", {})
