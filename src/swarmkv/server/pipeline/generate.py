"""Run a rendered request on the engine: submit its prompt, and collect its outputs unless the client leaves."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from swarmkv.api.chat_request import ChatRequest
from swarmkv.api.errors import bad_request
from swarmkv.api.layout import Api, resolve_layout
from swarmkv.api.options import Options, context_length_exceeded
from swarmkv.api.outputs import StepOutput
from swarmkv.api.reasoning import ReasoningSplitter, reasoning_splitter
from swarmkv.api.render import Encode, bounded_encode, render_request
from swarmkv.api.session_id import SESSION_HEADER, resolve_session_id
from swarmkv.api.structured_request import reply_constraint, special_markup
from swarmkv.api.tool_parser import ToolCall
from swarmkv.breaks.causes import Break, RenderedPrompt
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.errors import InvalidRequestError
from swarmkv.server.context import ServerContext
from swarmkv.server.engine_loop.commands import RequestPin
from swarmkv.server.engine_loop.request_stream import RequestStream
from swarmkv.server.http.disconnect import ClientDisconnected, unless_disconnected
from swarmkv.server.observability.latency import Latency

T = TypeVar("T")
# The body field each API's prompt is written in, which a prompt too long for the context names.
_PROMPT_PARAMS: dict[Api, str] = {"chat": "messages", "messages": "messages", "responses": "input"}


def request_session_id(
    request: Request,
    body_value: str | None,
    cache_key: str | None = None,
    client_header: str | None = None,
) -> str | None:
    """The request's session: `body_value` (named by its body), else its X-Session-Id header, else the client's
    own session header `client_header` when given, else the body's `prompt_cache_key` (`cache_key`), which names
    a cache, so a session named outright goes first; each checked."""
    client_value = request.headers.get(client_header) if client_header is not None else None
    session_id = resolve_session_id(body_value, request.headers.get(SESSION_HEADER), client_value)
    return session_id if session_id is not None else cache_key


async def submit(
    ctx: ServerContext,
    id_prefix: str,
    prompt_ids: list[int],
    params: SamplingParams,
    options: Options,
    session_id: str | None,
    arrival_s: float,
    pins: tuple[RequestPin, ...] = (),
) -> RequestStream:
    """Queue a prompt, with the pins it makes first, under a fresh request id, its salt and session its
    tenant's; the engine's refusal is a 400. The request is aborted once its HTTP request ends (a no-op if it
    finished), so no route has to abort it on each way out."""
    request_id = f"{id_prefix}-{uuid.uuid4().hex}"
    salt, session = ctx.tenant.cache_salt(options.cache_salt), ctx.tenant.scope(session_id)
    if ctx.submitted is not None:
        ctx.submitted.append(request_id)  # aborted when the HTTP request ends, however it ends
    try:
        return await ctx.engine.submit(
            request_id,
            prompt_ids,
            params,
            salt,
            arrival_s,
            session_id=session,
            pins=pins,
            on_end=ctx.log_ended,
        )
    except InvalidRequestError as exc:
        raise bad_request(str(exc)) from exc


@dataclass(frozen=True)
class StartedChat:
    """A submitted chat request: the request as it was rendered, its stream and prompt, the cache break it
    causes (if any), and the splitter of its reply's reasoning (None unless the model thinks)."""

    # In the template's tool-call format, a forced call closing a `<think>` the prompt opened.
    req: ChatRequest
    stream: RequestStream
    rendered: RenderedPrompt
    found: Awaitable[Break | None]
    reasoning: ReasoningSplitter | None
    note_tool: Callable[[Sequence[ToolCall]], None]  # the reply's calls, for the engine's return forecast


def render_for_model(
    ctx: ServerContext, req: ChatRequest, api: Api, encode: Encode | None = None
) -> tuple[ChatRequest, RenderedPrompt]:
    """The request as this model's template takes it, and its prompt, laid out as `--prompt-layout` says
    for `api` (`api.render.render_request`)."""
    return render_request(ctx.tokenizer, req, resolve_layout(ctx.prompt_layout, api), encode)


def prompt_encoder(ctx: ServerContext, prompt_param: str, text_prompt: bool = False) -> Encode:
    """The tokenizer's encode for prompts, refusing one too long for the context before it tokenizes."""
    return bounded_encode(ctx.tokenizer, ctx.max_model_len, prompt_param, text_prompt)


async def in_worker(work: Callable[[], T]) -> T:
    """`work()` (rendering, tokenizing) on a worker thread, so a huge prompt never stalls the event loop."""
    return await asyncio.to_thread(work)


async def render_in_worker(
    ctx: ServerContext, req: ChatRequest, api: Api
) -> tuple[ChatRequest, RenderedPrompt]:
    """`render_for_model` on a worker thread, a prompt too long for the context refused before it tokenizes."""
    encode = prompt_encoder(ctx, _PROMPT_PARAMS[api])
    return await in_worker(lambda: render_for_model(ctx, req, api, encode))


async def count_prompt(ctx: ServerContext, req: ChatRequest, api: Api) -> int:
    """The tokens of a chat request's prompt (the count routes), rendered as `start_chat` renders it; a 400
    from the context's length on, as what the server could never run it does not count to the end (a prompt
    of exactly `max_model_len` tokens leaves no room for a reply: `Options.sampling_params` refuses it too,
    as vLLM does)."""
    _, rendered = await render_in_worker(ctx, req, api)
    num_tokens = len(rendered.token_ids)
    if num_tokens >= ctx.max_model_len:
        raise context_length_exceeded(ctx.max_model_len, str(num_tokens), _PROMPT_PARAMS[api])
    return num_tokens


async def start_chat(
    ctx: ServerContext,
    req: ChatRequest,
    session_id: str | None,
    arrival_s: float,
    id_prefix: str,
    api: Api = "chat",
) -> StartedChat:
    """Render (on a worker thread) and submit a chat request."""
    req, rendered = await render_in_worker(ctx, req, api)
    return await start_rendered(ctx, req, rendered, session_id, arrival_s, id_prefix)


async def start_rendered(
    ctx: ServerContext,
    req: ChatRequest,
    rendered: RenderedPrompt,
    session_id: str | None,
    arrival_s: float,
    id_prefix: str,
    pins: tuple[RequestPin, ...] = (),
) -> StartedChat:
    """Submit a rendered chat request, in one command with the `pins` it makes first."""
    constraint = reply_constraint(
        req, special_markup(ctx.tokenizer), strict_only=ctx.tool_call_grammar == "strict"
    )  # a grammar is checked (and cached) when first seen: a worker's job
    params = req.options.sampling_params(
        len(rendered.token_ids),
        ctx.max_model_len,
        "messages",
        req.forced_stop(),
        ctx.max_tokens_policy,
        constraint,
    )
    stream = await submit(
        ctx, id_prefix, rendered.token_ids, params, req.options, session_id, arrival_s, pins
    )
    session, salt = ctx.tenant.scope(session_id), ctx.tenant.scope(req.options.cache_salt)
    found = ctx.breaks.watch(session, salt, rendered, ctx.tenant.name)
    # A forced call's reply is the rest of the call: nothing in it is reasoning.
    thinks = req.thinking_enabled and not req.forced_prefix()
    splitter = reasoning_splitter(ctx.tokenizer.chat_template, rendered.text, thinks)
    return StartedChat(
        req, stream, rendered, found, splitter, lambda calls: note_tool_call(ctx, session, calls)
    )


def note_tool_call(ctx: ServerContext, session: str | None, calls: Sequence[ToolCall]) -> None:
    """Tell the engine the tool the session's reply called (its first; None for none): the `return` retention
    forecasts the agent's pause from that tool's. Queued behind the request's own commands; a no-op without a
    session (`session`: the tenant's scoped id)."""
    if session is not None:
        tool = calls[0].name if calls else None
        ctx.engine.call(lambda engine: engine.core.note_tool_call(session, tool))


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
    # A cancelled route (its client left) is aborted by `http/disconnect.py`, which aborts what it submitted.
