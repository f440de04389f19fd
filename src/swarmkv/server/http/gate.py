"""Gate: the ASGI middleware in front of every route: the API-key check on /v1/ routes and the HTTP counts."""

from __future__ import annotations

import hmac
from typing import Any

from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from swarmkv.api.errors import APIError
from swarmkv.server.http.errors import error_response
from swarmkv.server.observability.metrics import ServerMetrics


class Gate:
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
                await error_response(error, path)(scope, receive, counting_send)
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
