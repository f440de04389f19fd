"""The app's exception handlers: every failure answers in OpenAI's error shape, or Anthropic's on its routes."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from swarmkv.api.errors import APIError
from swarmkv.api.messages_objects import anthropic_error
from swarmkv.api.paths import (
    CHAT_ROUTE,
    COMPLETIONS_ROUTE,
    MESSAGES_ROUTE,
    RESPONSES_ROUTE,
    is_messages_route,
)
from swarmkv.server.engine_loop.request_stream import EngineUnavailableError
from swarmkv.server.http.body import LARGE_BODY_BYTES
from swarmkv.server.http.disconnect import STATUS_CLIENT_GONE
from swarmkv.server.tenants import TENANT_SCOPE_KEY

log = logging.getLogger(__name__)
# The generation routes, whose refusals the request log records (`swarmkv lint` counts them).
_LOGGED_ROUTES = frozenset((CHAT_ROUTE, COMPLETIONS_ROUTE, MESSAGES_ROUTE, RESPONSES_ROUTE))


def error_response(error: APIError, path: str) -> JSONResponse:
    """`error` as the response a client of `path` expects."""
    # The Anthropic routes answer errors in Anthropic's shape, so its clients raise their typed errors.
    if is_messages_route(path):
        status, body = anthropic_error(error)
        return JSONResponse(body, status_code=status)
    return JSONResponse(error.to_json(), status_code=error.status)


async def api_error(request: Request, exc: Exception) -> Response:
    """A client mistake (a 4xx the routes raised)."""
    assert isinstance(exc, APIError)
    try:
        await _log_refused(request, exc)
    except Exception:  # nothing in logging a refusal may turn the client's 4xx into a 500
        log.exception("the request log could not record a refused request to %s", request.url.path)
    return error_response(exc, request.url.path)


async def _log_refused(request: Request, error: APIError) -> None:
    """Record a refused generation request in the request log, when there is one: on a worker thread, as
    capping and encoding a large body takes a while."""
    ctx = getattr(request.app.state, "ctx", None)
    path = request.url.path
    if ctx is None or ctx.request_log is None or request.method != "POST" or path not in _LOGGED_ROUTES:
        return
    raw: bytes | None = getattr(request.state, "raw_body", None)
    body = getattr(request.state, "json_body", None)
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    tenant_name = tenant.name if tenant is not None else None
    await asyncio.to_thread(
        lambda: ctx.request_log.write_refused(
            path,
            error.status,
            error.message,
            body if body is not None else _logged_body(raw),
            tenant_name,
            raw,
        )
    )


def _logged_body(raw: bytes | None) -> Any:
    """A body the parse refused, for the log: as JSON, as text when it is not JSON, or None when it was never
    read (too large) or is too large to decode again (the log names it by its size and digest)."""
    if raw is None or len(raw) > LARGE_BODY_BYTES:
        return None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8 (UnicodeDecodeError), or nested too deeply
        return raw.decode("utf-8", errors="replace")


async def http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors: an unknown path (404) or method (405)."""
    assert isinstance(exc, HTTPException)
    code = "not_found" if exc.status_code == 404 else None
    return error_response(
        APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code),
        request.url.path,
    )


async def engine_unavailable(request: Request, exc: Exception) -> Response:
    """The engine loop stopped or its step failed."""
    assert isinstance(exc, EngineUnavailableError)
    return error_response(APIError(exc.status, str(exc), error_type="server_error"), request.url.path)


async def client_gone(request: Request, exc: Exception) -> Response:
    """The client left while its body was still arriving: not a server error, and nobody reads the answer."""
    return Response(status_code=STATUS_CLIENT_GONE)


async def server_error(request: Request, exc: Exception) -> Response:
    """Anything else: logged, and a 500 that says no more."""
    log.error("unhandled error on %s", request.url.path, exc_info=exc)
    error = APIError(500, "the server failed on this request", error_type="server_error")
    return error_response(error, request.url.path)
