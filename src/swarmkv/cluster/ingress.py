"""The cluster's ingress: the same HTTP API as `swarmkv serve`, forwarded to engine replicas.

Each request gets its route key here (route_key.py) and goes through the Engine deployment's handle, whose
request router places it. A replica lost before the answer started is retried once on another replica
(non-streaming answers are buffered, so they retry at any point); a stream cut mid-way ends with a 503
error event, which clients retry. /metrics and /health fan out to every replica. The ingress checks the
Host, the key and the body's type first (`http.gate.refusal`), as one server's gate does, and reads a key's
tenant to route (`route_key.py`); replicas, reached only through it, check again but for /metrics.
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from swarmkv.cluster.cluster_metrics import merge
from swarmkv.cluster.config import ClusterConfig, load_tokenizer
from swarmkv.cluster.exchange import Exchange, ReplicaLost, error_event, unavailable
from swarmkv.cluster.forward import ANY_REPLICA, RESPONSE_HEADERS_DROPPED, ForwardedRequest, ReplicaInfo
from swarmkv.cluster.route_key import EMPTY_KEY, Routed, RouteKeyer
from swarmkv.server.http.browsers import BrowserChecks
from swarmkv.server.http.errors import error_response
from swarmkv.server.http.gate import refusal
from swarmkv.server.tenants import ANONYMOUS, TENANT_SCOPE_KEY, TenantKeys

_RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[^"]+)"')


class Ingress:
    """Ray Serve calls `__call__` with each HTTP request; `engine` is the Engine deployment's handle."""

    def __init__(self, engine: Any, config: ClusterConfig) -> None:
        self._engine = engine
        self._config = config
        tokenizer = load_tokenizer(config.model_kwargs.get("model"))
        self._keyer = RouteKeyer(tokenizer, prompt_layout=config.server.prompt_layout)
        self._tenants = TenantKeys.of(config.server.api_key, config.server.api_keys)
        self._pool: ReplicaInfo | None = None  # one replica's KV pool: the router's shadow index size
        self._browsers = BrowserChecks.of(config.server)

    async def __call__(self, request: Request) -> Response:
        """Answer one HTTP request."""
        path, method = request.url.path, request.method
        # The Host check and the key for /metrics here: replicas see no Host (it is dropped below) and
        # answer the fan-out without a key. Replicas check the rest again.
        error = refusal(request.scope, self._tenants, self._browsers, self._config.server.metrics_public)
        if error is not None:
            return error_response(error, path)
        if method == "GET" and path == "/metrics":
            return await self._metrics()
        if method == "GET" and path == "/health":
            return await self._health()
        body = await request.body()
        headers = tuple((k.lower(), v) for k, v in request.headers.items() if k.lower() != "host")
        tenant = request.scope.get(TENANT_SCOPE_KEY, ANONYMOUS)  # the key's, found by `refusal` above
        routed = self._keyer.route(method, path, dict(headers), body, tenant)
        target = routed.target
        if target is None and not routed.key.tokens and routed.key.session is None:
            target = ANY_REPLICA  # nothing to route on (models, cache view, a malformed body)
        pool = await self._replica_pool()
        req = ForwardedRequest(
            method, path, request.url.query, headers, body, routed.key, self._messages(path, body), target,
            replica_pages=pool.kv_pages, page_size=pool.page_size, retention=pool.retention,
        )  # fmt: skip
        return await self._forward(req, routed)

    def _messages(self, path: str, body: bytes) -> list[Any]:
        """What Ray's PrefixCacheAffinityRouter reads (the bench's comparison); ours routes on the key."""
        return _messages(path, body) if self._config.router == "ray-prefix" else [path]

    async def _replica_pool(self) -> ReplicaInfo:
        if self._pool is None:
            info = self._engine.info.remote()
            self._pool = await asyncio.wait_for(info, self._config.accept_timeout_s)
        assert self._pool is not None
        return self._pool

    async def _forward(self, req: ForwardedRequest, routed: Routed) -> Response:
        retried = False  # a request whose replica is lost is retried once, on another replica
        while True:
            exchange = Exchange(self._engine, req, self._config)
            try:
                head = await exchange.start()
                if head.header("content-type", "").startswith("text/event-stream"):
                    stream = self._stream(exchange, req, routed)
                    return StreamingResponse(stream, head.status, _headers(head.headers))
                body = await exchange.read_rest()
            except ReplicaLost as lost:
                if retried:
                    return unavailable(req.path, lost)
                retried = True
                req = replace(req, avoid=req.avoid + ((lost.replica,) if lost.replica else ()))
                continue
            replayed = self._replayed(req, routed, head.status)
            if replayed is not None:  # the chain's replica was lost: its items go along instead
                req = replayed
                continue
            self._after(req, routed, head.replica, head.status, body)
            return Response(body, head.status, _headers(head.headers))

    def _replayed(self, req: ForwardedRequest, routed: Routed, status: int) -> ForwardedRequest | None:
        """A continued Responses request that its replica no longer knows (a 404: the replica was lost and
        replaced), rewritten to carry its chain's items, for any replica; None otherwise."""
        if status != 404 or req.path != "/v1/responses" or routed.response_id is None:
            return None
        if req.target is None and routed.target is not None:
            return None  # already replayed once
        body = self._keyer.replay(req.body, routed.response_id, routed.tenant)
        return None if body is None else replace(req, body=body, target=None)

    async def _stream(self, exchange: Exchange, req: ForwardedRequest, routed: Routed) -> Any:
        seen_id = False
        events = bytearray()  # a stored response's stream, whose last event holds its output items
        try:
            async for chunk in exchange.chunks():
                if req.path == "/v1/responses" and routed.inputs:
                    events += chunk
                if not seen_id and req.path == "/v1/responses":
                    seen_id = self._after(req, routed, exchange.replica, 200, chunk, streamed=True)
                yield chunk
            completed = _completed_response(bytes(events))
            if completed is not None and exchange.replica is not None:
                self._remember(completed, routed, exchange.replica)
        except ReplicaLost as lost:
            yield error_event(req.path, lost)
        finally:
            exchange.cancel()

    def _remember(self, response: dict[str, Any], routed: Routed, replica: str) -> None:
        """Record a stored response with its chain's items: the request's inputs and its outputs."""
        output = response.get("output")
        outputs: list[Any] = output if isinstance(output, list) else []
        items = (*routed.inputs, *outputs) if routed.inputs else ()
        self._keyer.remember(str(response["id"]), routed.response_id, replica, items, routed.tenant)

    def _after(
        self,
        req: ForwardedRequest,
        routed: Routed,
        replica: str | None,
        status: int,
        body: bytes,
        streamed: bool = False,
    ) -> bool:
        """Remember a stored response's replica (or forget a deleted one); whether a response id was seen.
        A stream's first chunks name the response; its items are remembered when it completes."""
        if status != 200 or replica is None or not req.path.startswith("/v1/responses"):
            return False
        if req.method == "DELETE" and routed.response_id is not None:
            self._keyer.forget(routed.response_id, routed.tenant)
            return True
        match = _RESPONSE_ID.search(body)
        if req.method == "POST" and req.path == "/v1/responses" and match is not None:
            whole = None if streamed else _json_object(body)
            if whole is not None and whole.get("object") == "response":
                self._remember(whole, routed, replica)
            else:
                self._keyer.remember(match.group(1).decode(), routed.response_id, replica, (), routed.tenant)
        return match is not None

    async def _fan_out(self, path: str) -> dict[str, tuple[int, bytes, Any]]:
        """GET `path` on every replica: replica -> (status, body, route note); replicas lost are left out."""
        first = ForwardedRequest("GET", path, "", (), b"", EMPTY_KEY, [path], ANY_REPLICA)
        answers: dict[str, tuple[int, bytes, Any]] = {}

        async def one(req: ForwardedRequest) -> tuple[str, int, bytes, Any] | None:
            exchange = Exchange(self._engine, req, self._config)
            try:
                head = await exchange.start()
                return head.replica, head.status, await exchange.read_rest(), head.note
            except ReplicaLost:
                return None

        found = await one(first)
        if found is None:
            return answers
        answers[found[0]] = found[1:]
        note = found[3]
        others = [c for c in getattr(note, "candidates", ()) if c != found[0]]
        for result in await asyncio.gather(*(one(replace(first, target=c)) for c in others)):
            if result is not None:
                answers[result[0]] = result[1:]
        return answers

    async def _metrics(self) -> Response:
        answers = await self._fan_out("/metrics")
        notes = [a[2] for a in answers.values() if a[2] is not None]
        latest = max(notes, key=lambda n: sum(n.decisions.values()), default=None)
        texts = {replica: a[1].decode() for replica, a in answers.items() if a[0] == 200}
        body = merge(texts, latest.decisions if latest is not None else {})
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _health(self) -> Response:
        answers = await self._fan_out("/health")
        replicas = {replica: json.loads(a[1] or b"{}") for replica, a in answers.items()}
        healthy = any(a[0] == 200 for a in answers.values())
        status = {"status": "ok" if healthy else "no healthy replica", "replicas": replicas}
        return JSONResponse(status, status_code=200 if healthy else 503)


def _headers(headers: tuple[tuple[str, str], ...]) -> dict[str, str]:
    return {k: v for k, v in headers if k not in RESPONSE_HEADERS_DROPPED}


def _messages(path: str, body: bytes) -> list[Any]:
    """The request's raw chat messages (or prompt), read by Ray's PrefixCacheAffinityRouter; never empty."""
    try:
        payload = json.loads(body) if body else {}
    except ValueError:
        return [path]
    if not isinstance(payload, dict):
        return [path]
    for name in ("messages", "input", "prompt"):
        value = payload.get(name)
        if isinstance(value, list) and value:
            return value
        if isinstance(value, str) and value:
            return [value]
    return [path]


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _completed_response(events: bytes) -> dict[str, Any] | None:
    """The response object of a Responses stream's `response.completed` event, if the stream has one."""
    marker = b"event: response.completed\ndata: "
    at = events.rfind(marker)
    if at < 0:
        return None
    line = events[at + len(marker) :].split(b"\n", 1)[0]
    event = _json_object(line)
    response = event.get("response") if event is not None else None
    return response if isinstance(response, dict) and "id" in response else None
