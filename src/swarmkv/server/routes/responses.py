"""POST /v1/responses (and /input_tokens), GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat pipeline.

The body becomes a chat request (`api/responses_request.py`), runs through the same renderer, engine, tool
parser and stream as a chat completion (`pipeline/`), and its outputs are dressed as a response and its events
(`api/responses_objects.py`, `api/responses_stream.py`). A stored response
keeps its chain's items, so `previous_response_id` continues it in the chain's one session.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmkv.api.errors import APIError
from swarmkv.api.outputs import StepOutput
from swarmkv.api.paths import CHAT_ROUTE
from swarmkv.api.reasoning import ReasoningSplitter
from swarmkv.api.responses_objects import (
    EventWriter,
    ResponseHead,
    function_call_item,
    is_incomplete,
    message_item,
    new_id,
    reasoning_item,
    usage,
)
from swarmkv.api.responses_request import (
    RESPONSES_ARRAYS,
    Item,
    ResponsesRequest,
    parse_item,
    parse_responses_request,
    previous_response_id,
)
from swarmkv.api.responses_stream import OutputItems
from swarmkv.server.context import ServerContext, request_context
from swarmkv.server.engine_loop.request_stream import EngineUnavailableError
from swarmkv.server.http.disconnect import STATUS_CLIENT_GONE
from swarmkv.server.http.event_stream import EventStream
from swarmkv.server.observability.latency import Latency
from swarmkv.server.pipeline.chat_stream import chat_deltas, parse_whole_reply
from swarmkv.server.pipeline.generate import (
    StartedChat,
    collect_unless_disconnected,
    count_prompt,
    request_session_id,
    start_chat,
)
from swarmkv.server.responses_store import StoredResponse

# Called with the finished response object and its output items, to store them.
OnDone = Callable[[dict[str, Any], list[Item]], None]


async def create_response(request: Request) -> Response:
    """POST /v1/responses."""
    arrival_s = time.perf_counter()
    ctx = request_context(request)
    req, previous = await _parse(ctx, request)
    response_id = new_id("resp")
    named = request_session_id(request, None, req.chat.options.prompt_cache_key)
    # A chain is one session, named by its first response (unless the X-Session-Id header or the
    # prompt_cache_key names one), so its KV is kept between turns.
    session_id = previous.session_id if previous else named or (response_id if req.store else None)
    started = await start_chat(ctx, req.chat, session_id, arrival_s, "resp", "responses")
    # Logged once it runs, as the chat request it runs as.
    await ctx.log_request(
        CHAT_ROUTE, session_id, req.chat_body, started.rendered.text, started.stream.request_id, "responses"
    )
    stream = started.stream
    head = ResponseHead(
        response_id,
        int(time.time()),
        ctx.reply_model(req.chat.options.model),
        req.previous_response_id,
        req.echo,
    )
    latency = Latency(ctx.metrics, arrival_s)

    def on_done(body: dict[str, Any], output: list[Item]) -> None:
        if req.store and session_id is not None:
            history = previous.items if previous else []
            items = history + req.input_items + [parse_item("output", item) for item in output]
            stored = StoredResponse(body, items, session_id, ctx.responses.now_s(), ctx.tenant.name)
            ctx.responses.put(response_id, stored)

    if req.chat.options.stream:
        return EventStream(
            _events(req, started, latency, head, on_done), lambda: ctx.engine.abort(stream.request_id)
        )
    outputs = await collect_unless_disconnected(request, ctx, stream, latency)
    if outputs is None:
        return Response(status_code=STATUS_CLIENT_GONE)
    last = outputs[-1] if outputs else None
    chat = started.req
    parsed = parse_whole_reply(chat, outputs, chat.tool_format, started.reasoning, started.note_tool)
    output = (
        [reasoning_item(new_id("rs"), parsed.reasoning, req.reasoning_summary)] if parsed.reasoning else []
    )
    if parsed.content or not parsed.tool_calls:
        output.append(message_item(new_id("msg"), parsed.content))
    output += [
        function_call_item(new_id("fc"), call, namespace=req.namespaces.get(call.name))
        for call in parsed.tool_calls
    ]
    body = _finished(head, output, last, len(parsed.tool_calls), started.reasoning)
    on_done(body, output)
    return JSONResponse(body)


async def count_input_tokens(request: Request) -> Response:
    """POST /v1/responses/input_tokens: the prompt's length as /v1/responses would render it, nothing generated."""
    ctx = request_context(request)
    req, _ = await _parse(ctx, request)
    num_tokens = await count_prompt(ctx, req.chat, "responses")
    return JSONResponse({"object": "response.input_tokens", "input_tokens": num_tokens})


async def get_response(request: Request) -> Response:
    """GET /v1/responses/{id}: a stored response; 404 if unknown, expired, not stored or another tenant's."""
    ctx = request_context(request)
    response_id = request.path_params["response_id"]
    stored = ctx.responses.get(response_id, ctx.tenant.name)
    if stored is None:
        raise _not_found(response_id, None)
    return JSONResponse(stored.body)


async def delete_response(request: Request) -> Response:
    """DELETE /v1/responses/{id}: forget it; deleting a chain's newest response releases the chain's session."""
    ctx = request_context(request)
    response_id = request.path_params["response_id"]
    deleted = ctx.responses.delete(response_id, ctx.tenant.name)
    if deleted is None:
        raise _not_found(response_id, None)
    stored, was_newest = deleted
    if was_newest:
        session_id = ctx.tenant.scope(stored.session_id)
        assert session_id is not None
        await asyncio.wrap_future(ctx.engine.call(lambda engine: engine.release_session(session_id)))
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def _parse(ctx: ServerContext, request: Request) -> tuple[ResponsesRequest, StoredResponse | None]:
    """The validated body and the stored response it continues; a 404 for an unknown previous_response_id."""
    payload = await ctx.read_body(request, RESPONSES_ARRAYS)
    prev_id = previous_response_id(payload)
    previous = ctx.responses.get(prev_id, ctx.tenant.name) if prev_id is not None else None
    if prev_id is not None and previous is None:
        raise _not_found(prev_id, "previous_response_id")
    req = parse_responses_request(payload, previous.items if previous else [], ctx.hosted_tools)
    ctx.check_model(req.chat.options.model)
    return req, previous


def _not_found(response_id: str, param: str | None) -> APIError:
    return APIError(
        404,
        f"no stored response {response_id!r}: it was never stored (store: false), was deleted, or expired",
        param=param,
        code="response_not_found",
    )


def _finished(
    head: ResponseHead,
    output: list[Item],
    last: StepOutput | None,
    num_calls: int,
    reasoning: ReasoningSplitter | None,
) -> dict[str, Any]:
    incomplete = is_incomplete(last, num_calls)
    totals = usage(last, reasoning.num_tokens if reasoning is not None else 0)
    return head.body("incomplete" if incomplete else "completed", output, totals, incomplete)


async def _events(
    req: ResponsesRequest,
    started: StartedChat,
    latency: Latency,
    head: ResponseHead,
    on_done: OnDone,
) -> AsyncIterator[str]:
    emit = EventWriter()
    yield emit("response.created", {"response": head.body("in_progress", [], None)})
    yield emit("response.in_progress", {"response": head.body("in_progress", [], None)})
    items = OutputItems(emit, req.namespaces, req.reasoning_summary)
    last: StepOutput | None = None
    chat = started.req
    try:
        async for out, parsed in chat_deltas(
            chat, started.stream, latency, chat.tool_format, started.reasoning, started.note_tool
        ):
            last = out
            for event in items.add(parsed):
                yield event
    except EngineUnavailableError as exc:
        yield emit("error", {"code": "server_error", "message": str(exc), "param": None})
        return
    for event in items.close():
        yield event
    output = items.output
    body = _finished(head, output, last, items.num_calls, started.reasoning)
    on_done(body, output)
    # Always response.completed (the body's status says "incomplete"): the openai client's stream helpers
    # finish on that event alone.
    yield emit("response.completed", {"response": body})
