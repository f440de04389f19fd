"""The ASGI app: OpenAI (chat, completions, Responses) and Anthropic Messages routes, the cache view, /health, /metrics, API-key check and OpenAI-shaped errors."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from swarmkv.engine.llm import LLM
from swarmkv.server.async_engine import AsyncEngine
from swarmkv.server.cache_breaks import CacheBreaks
from swarmkv.server.cache_view import cache_page, cache_tree
from swarmkv.server.cli import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_RESPONSES_STORE_MAX
from swarmkv.server.completions import chat_completions, completions
from swarmkv.server.context import ServerContext
from swarmkv.server.disconnect import STATUS_CLIENT_GONE
from swarmkv.server.messages import count_tokens, messages
from swarmkv.server.messages_responses import anthropic_error, is_messages_route
from swarmkv.server.metrics import ServerMetrics
from swarmkv.server.pins import create_pin, delete_pin, get_pin
from swarmkv.server.protocol import APIError
from swarmkv.server.request_log import RequestLog
from swarmkv.server.request_stream import EngineUnavailableError
from swarmkv.server.responses_api import count_input_tokens, create_response, delete_response, get_response
from swarmkv.server.responses_store import ResponseStore
from swarmkv.server.sessions import release_session

log = logging.getLogger(__name__)


def default_model_name(llm: LLM) -> str:
    """The name clients send as `model`: the checkpoint's file stem or folder name."""
    path = llm.loaded.path
    return path.stem if path.is_file() else path.name


def create_app(
    llm: LLM,
    api_key: str | None = None,
    model_name: str | None = None,
    log_requests: Path | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    responses_store_max: int = DEFAULT_RESPONSES_STORE_MAX,
) -> Starlette:
    """An app serving `llm`; its engine loop runs while the app's lifespan does. One app per LLM.

    `log_requests`: a JSON-lines file every generation request's body is appended to (see request_log.py).
    `responses_store_max`: how many stored /v1/responses responses `previous_response_id` can continue.
    """
    engine = AsyncEngine(llm.engine)
    metrics = ServerMetrics(engine.stats)
    ctx = ServerContext(
        engine=engine,
        tokenizer=llm.tokenizer,
        model_name=model_name or default_model_name(llm),
        max_model_len=llm.engine.max_model_len,
        metrics=metrics,
        breaks=CacheBreaks(llm.tokenizer, metrics.cache_breaks),
        request_log=RequestLog(log_requests) if log_requests is not None else None,
        max_request_bytes=max_request_bytes,
        responses=ResponseStore(responses_store_max),
    )

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()
            if ctx.request_log is not None:
                ctx.request_log.close()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/input_tokens", count_input_tokens, methods=["POST"]),
        Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
        Route("/v1/models", models, methods=["GET"]),
        # `path`: a session id may hold "/" (sent percent-encoded).
        Route("/v1/sessions/{session_id:path}/release", release_session, methods=["POST"]),
        Route("/v1/cache/pin", create_pin, methods=["POST"]),
        Route("/v1/cache/pin/{pin_id}", get_pin, methods=["GET"]),
        Route("/v1/cache/pin/{pin_id}", delete_pin, methods=["DELETE"]),
        Route("/v1/cache/tree", cache_tree, methods=["GET"]),
        Route("/cache", cache_page, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_route, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[Middleware(_Gate, api_key=api_key, metrics=metrics, routes=routes)],
        exception_handlers={
            APIError: _api_error,
            HTTPException: _http_error,
            EngineUnavailableError: _engine_unavailable,
            ClientDisconnect: _client_gone,
            Exception: _server_error,
        },
    )
    app.state.ctx = ctx
    return app


async def models(request: Request) -> Response:
    """GET /v1/models: the one model this server runs."""
    ctx: ServerContext = request.app.state.ctx
    card = {
        "id": ctx.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "swarmkv",
        "max_model_len": ctx.max_model_len,
    }
    return JSONResponse({"object": "list", "data": [card]})


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


async def metrics_route(request: Request) -> Response:
    """GET /metrics in the Prometheus text format."""
    ctx: ServerContext = request.app.state.ctx
    return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def _error_response(error: APIError, path: str) -> JSONResponse:
    # The Anthropic routes answer errors in Anthropic's shape, so its clients raise their typed errors.
    if is_messages_route(path):
        status, body = anthropic_error(error)
        return JSONResponse(body, status_code=status)
    return JSONResponse(error.to_json(), status_code=error.status)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return _error_response(exc, request.url.path)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else None
    return _error_response(
        APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code),
        request.url.path,
    )


async def _engine_unavailable(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, EngineUnavailableError)
    return _error_response(APIError(exc.status, str(exc), error_type="server_error"), request.url.path)


async def _client_gone(request: Request, exc: Exception) -> Response:
    # The client left while its body was still arriving: not a server error, and nobody reads the answer.
    return Response(status_code=STATUS_CLIENT_GONE)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    error = APIError(500, "the server failed on this request", error_type="server_error")
    return _error_response(error, request.url.path)


class _Gate:
    """Counts every answer by route and status; on /v1/ routes requires `Authorization: Bearer KEY` or
    Anthropic's `x-api-key: KEY`."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, metrics: ServerMetrics, routes: list[Route]
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.metrics = metrics
        self.routes = routes

    def _route_label(self, path: str) -> str:
        """The matching route's template (ids never become labels, bounding cardinality), else "other"."""
        return next((r.path for r in self.routes if r.path_regex.match(path)), "other")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = 500  # if the app dies before it starts a response

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            if path.startswith("/v1/") and not self._authorized(scope):
                error = APIError(
                    401,
                    "a valid API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                    code="invalid_api_key",
                )
                await _error_response(error, path)(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            self.metrics.http_requests.labels(route=self._route_label(path), status=str(status)).inc()

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None:
            return True
        headers: dict[bytes, Any] = dict(scope["headers"])
        key = self.api_key.encode()
        x_api_key = headers.get(b"x-api-key")
        if x_api_key is not None and hmac.compare_digest(bytes(x_api_key).strip(), key):
            return True
        given = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)
