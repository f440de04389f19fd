"""GET /, /v1/models, /v1/engine (the resolved settings), /health and /metrics: what this server is, its model, whether its engine works, its counters."""

from __future__ import annotations

import asyncio
import dataclasses

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmkv.resolve import PromptLayouts
from swarmkv.server.context import ServerContext


async def models(request: Request) -> Response:
    """GET /v1/models: the one model this server runs, once under each of its names ("*" is none)."""
    ctx: ServerContext = request.app.state.ctx
    cards = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "swarmkv",
            "max_model_len": ctx.max_model_len,
        }
        for name in ctx.listed_model_names
    ]
    return JSONResponse({"object": "list", "data": cards})


async def root(request: Request) -> Response:
    """GET (or HEAD) /: what answers here. Clients probe it before their first request (Claude Code warms
    its connection with `HEAD /`), so it is a 200, not a 404 in their logs."""
    ctx: ServerContext = request.app.state.ctx
    return JSONResponse({"server": "swarmkv", "models": list(ctx.listed_model_names), "api": "/v1"})


async def health(request: Request) -> Response:
    """GET /health: 200 while the engine loop runs and its latest step (or a probe) succeeded, else 503."""
    ctx: ServerContext = request.app.state.ctx
    if not ctx.engine.is_running:
        return JSONResponse({"status": "engine stopped"}, status_code=503)
    if ctx.engine.last_step_error is not None:  # is it still failing? an idle engine tries one token
        await asyncio.wrap_future(ctx.engine.call(lambda engine: engine.probe()))
    error = ctx.engine.last_step_error
    if error is not None:
        return JSONResponse({"status": "engine step failed", "error": error}, status_code=503)
    return JSONResponse({"status": "ok"})


async def engine_settings(request: Request) -> Response:
    """GET /v1/engine: the settings the engine runs with, every `auto` resolved (`swarmkv.resolve`), and the
    prompt layout each API gets."""
    ctx: ServerContext = request.app.state.ctx
    layouts = PromptLayouts.of(ctx.prompt_layout)
    return JSONResponse(
        {**ctx.engine.engine.settings.to_dict(), "prompt_layout": dataclasses.asdict(layouts)}
    )


async def metrics(request: Request) -> Response:
    """GET /metrics in the Prometheus text format."""
    ctx: ServerContext = request.app.state.ctx
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)
