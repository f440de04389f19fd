"""One request's exchange with an engine replica through the Engine deployment's streaming handle, with
timeouts on every wait and a replica's loss turned into ReplicaLost (the ingress retries or answers 503)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from ray.exceptions import RayError
from starlette.responses import JSONResponse

from swarmkv.api.errors import APIError
from swarmkv.api.messages_objects import anthropic_error
from swarmkv.api.paths import is_messages_route
from swarmkv.cluster.config import ClusterConfig
from swarmkv.cluster.forward import ForwardedRequest, ResponseHead


class ReplicaLost(Exception):
    """The replica serving a request died, was unreachable or went silent past the timeout."""

    def __init__(self, replica: str | None, why: str) -> None:
        super().__init__(why)
        self.replica = replica


class Exchange:
    """Yields of `EngineReplica.serve_http`: the replica's id, the ResponseHead, then body chunks."""

    def __init__(self, engine: Any, req: ForwardedRequest, config: ClusterConfig) -> None:
        self._gen = engine.options(stream=True).serve_http.remote(req)
        self._config = config
        self.replica: str | None = None

    async def _next(self, timeout_s: float) -> Any:
        try:
            return await asyncio.wait_for(self._gen.__anext__(), timeout_s)
        except StopAsyncIteration:
            raise
        except (TimeoutError, RayError, RuntimeError) as exc:
            self.cancel()
            why = "timed out" if isinstance(exc, asyncio.TimeoutError) else type(exc).__name__
            raise ReplicaLost(self.replica, f"replica {self.replica or '(unassigned)'} lost: {why}") from exc

    async def start(self) -> ResponseHead:
        """Wait for a replica to take the request, then for its response head."""
        try:
            self.replica = await self._next(self._config.accept_timeout_s)
            head = await self._next(self._config.request_timeout_s)
        except StopAsyncIteration as exc:
            raise ReplicaLost(self.replica, "the replica ended the exchange without an answer") from exc
        assert isinstance(head, ResponseHead)
        return head

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's chunks as they come."""
        while True:
            try:
                chunk = await self._next(self._config.request_timeout_s)
            except StopAsyncIteration:
                return
            yield chunk

    async def read_rest(self) -> bytes:
        """The whole remaining body."""
        return b"".join([chunk async for chunk in self.chunks()])

    def cancel(self) -> None:
        """Stop the replica's side (it sees the client gone and aborts the request)."""
        self._gen.cancel()


def _error(path: str, lost: ReplicaLost) -> tuple[int, dict[str, Any]]:
    message = f"the replica serving this request was lost ({lost}); retry the request"
    error = APIError(503, message, code="replica_lost", error_type="server_error")
    return anthropic_error(error) if is_messages_route(path) else (503, error.to_json())


def unavailable(path: str, lost: ReplicaLost) -> JSONResponse:
    """A 503 in the route's error shape (OpenAI's; Anthropic's on /v1/messages)."""
    status, body = _error(path, lost)
    return JSONResponse(body, status_code=status)


def error_event(path: str, lost: ReplicaLost) -> bytes:
    """The server-sent event that ends a stream whose replica was lost."""
    _, body = _error(path, lost)
    if is_messages_route(path):
        return f"event: error\ndata: {json.dumps(body)}\n\n".encode()
    return f"data: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
