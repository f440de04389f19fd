"""/v1/cache/pin: hold a prefix's KV pages (a swarm's system prompt and tools) so eviction never drops them.

POST pins a prefix and answers once its prefill finished and the engine holds its pages; GET shows a
pin; DELETE unpins it. A pin past the engine's cap is a 400 with code "pin_limit_exceeded": the cap is
a configured limit a retry cannot pass until the client unpins something, so it is not a 429 (which
OpenAI clients retry on their own). With `--api-keys`, a pin is its tenant's: another tenant's pin id is a
404, and each tenant may pin its share of `max_pinned_memory` (the cap over the number of tenants).
"""

from __future__ import annotations

import asyncio
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmkv.api.errors import APIError, bad_request
from swarmkv.api.layout import resolve_layout
from swarmkv.api.pin_objects import pin_json
from swarmkv.api.pin_request import PIN_ARRAYS, parse_pin_request
from swarmkv.api.render import render_pin
from swarmkv.engine.engine import LLMEngine
from swarmkv.errors import InvalidRequestError, PinLimitError
from swarmkv.server.context import ServerContext, request_context
from swarmkv.server.http.disconnect import STATUS_CLIENT_GONE, ClientDisconnected, unless_disconnected
from swarmkv.server.pipeline.generate import in_worker, prompt_encoder


def _not_found(pin_id: str) -> APIError:
    return APIError(
        404, f"no pin {pin_id!r}: it was never made, expired or was unpinned", code="pin_not_found"
    )


async def check_pin_share(ctx: ServerContext, num_tokens: int) -> None:
    """PinLimitError when a pin of `num_tokens` would take the tenant past its share of the pinned memory
    (max_pinned_memory / the number of tenants), so that one tenant's pins never leave another's no room.

    Checked just before the pin is queued: two pins of one tenant racing may both pass, past its share
    but never past the engine's cap."""
    group = ctx.tenant.name
    if group is None or ctx.num_tenants == 1:
        return
    share = ctx.num_tenants

    def check(engine: LLMEngine) -> None:
        engine.core.pins.check_share(group, num_tokens, engine.core.pins.max_bytes // share)

    await asyncio.wrap_future(ctx.engine.call(check))


def engine_pin_id(ctx: ServerContext, pin_id: str) -> str:
    """The engine's id of the tenant's pin: another tenant's pin of that id is not this one (a 404)."""
    engine_id = ctx.tenant.scope(pin_id)
    assert engine_id is not None
    return engine_id


async def create_pin(request: Request) -> Response:
    """POST /v1/cache/pin: pin `messages` (+ `tools`) or `prompt_token_ids` for `ttl_s` seconds."""
    ctx = request_context(request)
    req = parse_pin_request(await ctx.read_body(request, PIN_ARRAYS))
    ctx.check_model(req.model)
    layout = resolve_layout(ctx.prompt_layout, "chat")  # as chat prompts are
    encode = prompt_encoder(ctx, "messages")
    ids = await in_worker(lambda: render_pin(ctx.tokenizer, req, layout, encode))
    pin_id = f"pin-{uuid.uuid4().hex}"
    try:
        await check_pin_share(ctx, len(ids))
    except PinLimitError as exc:
        raise APIError(400, str(exc), code="pin_limit_exceeded") from exc
    pinning = ctx.engine.pin(
        engine_pin_id(ctx, pin_id), ids, req.ttl_s, ctx.tenant.cache_salt(req.cache_salt)
    )
    try:
        info = await unless_disconnected(request, pinning)
    except PinLimitError as exc:
        raise APIError(400, str(exc), code="pin_limit_exceeded") from exc
    except InvalidRequestError as exc:
        raise bad_request(str(exc)) from exc
    except ClientDisconnected:
        return Response(status_code=STATUS_CLIENT_GONE)  # and the pin was dropped
    if info is None:
        raise APIError(
            404, "the pin was deleted, or its TTL ran out, before it was ready", code="pin_not_found"
        )
    return JSONResponse({**pin_json(info), "id": pin_id})


async def get_pin(request: Request) -> Response:
    """GET /v1/cache/pin/{pin_id}: the pin's size and remaining time, or 404."""
    ctx = request_context(request)
    pin_id = request.path_params["pin_id"]
    engine_id = engine_pin_id(ctx, pin_id)
    info = await asyncio.wrap_future(ctx.engine.call(lambda engine: engine.get_pin(engine_id)))
    if info is None:
        raise _not_found(pin_id)
    return JSONResponse({**pin_json(info), "id": pin_id})


async def delete_pin(request: Request) -> Response:
    """DELETE /v1/cache/pin/{pin_id}: unpin; its pages stay cached (evictable) like any finished request's."""
    ctx = request_context(request)
    pin_id = request.path_params["pin_id"]
    if not await ctx.engine.unpin(engine_pin_id(ctx, pin_id)):
        raise _not_found(pin_id)
    return JSONResponse({"id": pin_id, "object": "cache.pin", "deleted": True})
