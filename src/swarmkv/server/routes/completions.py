"""POST /v1/completions: validate, encode the prompt, submit, then stream pieces or answer one text_completion."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmkv.api.completion_request import COMPLETION_ARRAYS, parse_completion_request
from swarmkv.api.completions_objects import Envelope, finish_reason, sse, usage
from swarmkv.api.errors import APIError
from swarmkv.api.outputs import StepOutput
from swarmkv.api.paths import COMPLETIONS_ROUTE
from swarmkv.api.render import render_completion
from swarmkv.api.structured_request import format_constraint, parse_response_format
from swarmkv.server.context import request_context
from swarmkv.server.engine_loop.request_stream import EngineUnavailableError, RequestStream
from swarmkv.server.http.disconnect import STATUS_CLIENT_GONE
from swarmkv.server.http.event_stream import EventStream
from swarmkv.server.observability.latency import Latency
from swarmkv.server.pipeline.generate import (
    collect_unless_disconnected,
    in_worker,
    prompt_encoder,
    request_session_id,
    submit,
)


async def completions(request: Request) -> Response:
    """POST /v1/completions."""
    arrival_s = time.perf_counter()
    ctx = request_context(request)
    body = await ctx.read_body(request, COMPLETION_ARRAYS)
    req = parse_completion_request(body)
    ctx.check_model(req.options.model)
    session_id = request_session_id(request, req.options.session_id)
    encode = prompt_encoder(ctx, "prompt", text_prompt=True)
    prompt_ids = await in_worker(lambda: render_completion(ctx.tokenizer, req.prompt, encode))
    constraint = format_constraint(parse_response_format(body))
    params = req.options.sampling_params(
        len(prompt_ids),
        ctx.max_model_len,
        "prompt",
        max_tokens_policy=ctx.max_tokens_policy,
        constraint=constraint,
    )
    stream = await submit(ctx, "cmpl", prompt_ids, params, req.options, session_id, arrival_s)
    # Logged once it runs; a prompt of token ids is cut at no length of text.
    prompt_text = req.prompt if isinstance(req.prompt, str) else ""
    await ctx.log_request(COMPLETIONS_ROUTE, session_id, body, prompt_text, stream.request_id)
    env = Envelope(stream.request_id, int(time.time()), ctx.reply_model(req.options.model))
    latency = Latency(ctx.metrics, arrival_s)
    if req.options.stream:
        events = _completion_events(env, req.options.include_usage, stream, latency)
        return EventStream(events, lambda: ctx.engine.abort(stream.request_id))
    outputs = await collect_unless_disconnected(request, ctx, stream, latency)
    if outputs is None:
        return Response(status_code=STATUS_CLIENT_GONE)
    last = outputs[-1] if outputs else None
    text = "".join(o.text for o in outputs)
    return JSONResponse(env.completion(text, finish_reason(last, 0), usage(last)))


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
    yield sse(env.completion_chunk("", finish_reason(last, 0), with_usage_field=with_usage))
    if with_usage:
        yield sse(env.usage_chunk("text_completion", usage(last)))
    yield sse("[DONE]")
