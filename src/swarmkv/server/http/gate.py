"""Gate: the ASGI middleware in front of every route: the API-key check on /v1/ routes and the HTTP counts."""

from __future__ import annotations

from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from swarmkv.api.errors import APIError
from swarmkv.server.http.errors import error_response
from swarmkv.server.observability.metrics import ServerMetrics
from swarmkv.server.tenants import TENANT_SCOPE_KEY, TenantKeys


class Gate:
    """Counts every answer by route and status; on /v1/ routes requires `Authorization: Bearer KEY` or
    Anthropic's `x-api-key: KEY`, and leaves the key's tenant in the scope (`tenants.py`)."""

    def __init__(
        self, app: ASGIApp, tenants: TenantKeys, metrics: ServerMetrics, routes: list[Route]
    ) -> None:
        self.app = app
        self.tenants = tenants
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
            tenant = self.tenants.authenticate(scope["headers"])
            if tenant is not None:
                scope[TENANT_SCOPE_KEY] = tenant
            if path.startswith("/v1/") and tenant is None:
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
