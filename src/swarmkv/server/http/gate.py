"""Gate: the ASGI middleware in front of every route: the browser checks, the API key and the HTTP counts."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from swarmkv.api.errors import APIError
from swarmkv.server.http.browsers import BrowserChecks
from swarmkv.server.http.errors import error_response
from swarmkv.server.observability.metrics import ServerMetrics
from swarmkv.server.tenants import TENANT_SCOPE_KEY, TenantKeys


class Gate:
    """Counts every answer by route and status. Refuses, in order: a Host it does not answer (400); on /v1/
    routes, and on /metrics unless `metrics_public`, a request without `Authorization: Bearer KEY` or
    Anthropic's `x-api-key: KEY` (401); under `--api-keys`, /metrics with a tenant's key that is not an
    admin's, unless `metrics_public` (403); a POST whose body is not JSON (415); a write from another site (403).
    A request's key leaves its tenant in the scope (`tenants.py`)."""

    def __init__(
        self,
        app: ASGIApp,
        tenants: TenantKeys,
        metrics: ServerMetrics,
        routes: list[Route],
        browsers: BrowserChecks,
        metrics_public: bool = False,
    ) -> None:
        self.app = app
        self.tenants = tenants
        self.metrics = metrics
        self.routes = routes
        self.browsers = browsers
        self.metrics_public = metrics_public

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
            error = self._refusal(scope)
            if error is not None:
                await error_response(error, path)(scope, receive, counting_send)
            else:
                await self.app(scope, receive, counting_send)
        finally:
            self.metrics.http_requests.labels(route=self._route_label(path), status=str(status)).inc()

    def _refusal(self, scope: Scope) -> APIError | None:
        return refusal(scope, self.tenants, self.browsers, self.metrics_public)


def refusal(
    scope: Scope, tenants: TenantKeys, browsers: BrowserChecks, metrics_public: bool
) -> APIError | None:
    """Why the request is refused before any route sees it, or None; a key's tenant is left in the scope.
    The gate asks it of every request, and the cluster's ingress of those it answers itself."""
    headers = Headers(scope=scope)
    path = scope["path"]
    wrong_host = browsers.host_refusal(headers)
    if wrong_host is not None:
        return wrong_host
    tenant = tenants.authenticate(scope["headers"])
    if tenant is not None:
        scope[TENANT_SCOPE_KEY] = tenant
    needs_key = path.startswith("/v1/") or (path == "/metrics" and not metrics_public)
    if needs_key and tenant is None:
        return APIError(
            401,
            "a valid API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            code="invalid_api_key",
        )
    if path == "/metrics" and not metrics_public and tenant is not None and not tenant.sees_all:
        # Server-wide counters would show one tenant another's traffic (its prompt tokens, its grammars).
        return APIError(
            403,
            "under --api-keys, /metrics shows every tenant's traffic and needs an admin key (a third word "
            "'admin' on its line of the key file)",
            code="admin_key_required",
        )
    return browsers.write_refusal(scope["method"], path, headers)
