"""A request's work ends when its client disconnects: the route is cancelled, what it queued is aborted.

Starlette cancels no handler whose client left, and before a stream's first byte nothing reads the socket, so
a request waiting for the engine's admission or rendering its prompt ran on for nobody, and was computed for
a step or more. `CancelOnDisconnect`, an ASGI middleware, reads the client's side once the body is in: on a
disconnect before the answer ends it cancels the route, and whatever the route had handed the engine (the
request ids `submit` records in the scope, `submitted`) is aborted, however the route ended. The engine applies
an abort between two steps. As the middleware that holds those ids, it also names the engine request in
the answer's `X-Request-Id` header, the id the request log's lines carry (`observability/request_log.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

T = TypeVar("T")

# nginx's "client closed request": logged and counted, never seen by the client.
STATUS_CLIENT_GONE = 499
SUBMITTED_SCOPE_KEY = "swarmkv.submitted"  # the engine request ids a request's route submitted
REQUEST_ID_HEADER = b"x-request-id"


def submitted(scope: Scope) -> list[str] | None:
    """The list a route adds its engine requests' ids to (None outside `CancelOnDisconnect`)."""
    ids: list[str] | None = scope.get(SUBMITTED_SCOPE_KEY)
    return ids


class CancelOnDisconnect:
    """Cancels a route whose client disconnects before its answer ended; aborts the engine requests the route
    submitted once it ends, whichever way (`abort` is a no-op for a finished request)."""

    def __init__(self, app: ASGIApp, abort: Callable[[str], None]) -> None:
        self.app = app
        self.abort = abort

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ids: list[str] = []
        scope[SUBMITTED_SCOPE_KEY] = ids
        watch = _Watch(receive, send, ids)
        route = asyncio.ensure_future(self.app(scope, watch.receive, watch.send))
        watch.route = route
        try:
            await route
        except asyncio.CancelledError:
            if not (watch.gone.is_set() and route.cancelled()):
                raise  # the server is stopping: not ours to swallow
            if not watch.started:  # counted as the client's leaving (the gate counts this status)
                await send({"type": "http.response.start", "status": STATUS_CLIENT_GONE, "headers": []})
        finally:
            watch.stop()
            for request_id in ids:
                self.abort(request_id)


class _Watch:
    """The route's receive and send: once the body is in, the client's side is read here alone, and a
    disconnect cancels the route unless its answer has ended."""

    def __init__(self, receive: Receive, send: Send, submitted: list[str]) -> None:
        self._receive = receive
        self._send = send
        self._submitted = submitted  # the route's engine requests: the last is the one its answer is
        self.route: asyncio.Future[None] | None = None
        self.gone = asyncio.Event()
        self.started = False  # the answer's head went out
        self.ended = False  # the answer's last byte went out
        self._watcher: asyncio.Task[None] | None = None

    async def receive(self) -> Message:
        if self._watcher is None:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone.set()
            elif not message.get("more_body", False):
                self._watcher = asyncio.ensure_future(self._watch())
            return message
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            if self._submitted:
                request_id = (REQUEST_ID_HEADER, self._submitted[-1].encode("latin-1"))
                message = {**message, "headers": [*message.get("headers", []), request_id]}
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.ended = True
        await self._send(message)

    async def _watch(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self.gone.set()
        if not self.ended and self.route is not None:
            self.route.cancel()

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()


class ClientDisconnected(Exception):
    """The client closed the connection before the work finished; the work was cancelled."""


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`await work`, but cancel it and raise ClientDisconnected if the client goes away first.

    Starlette does not cancel a handler whose client left, so a non-streamed handler that waits on the
    engine must watch for the disconnect itself, or the engine keeps working for nobody.
    """

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    working = asyncio.ensure_future(work)
    watching = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
        gone = not working.done()
        if gone:
            working.cancel()  # the work's own cancellation handling releases what it took
    if gone:
        raise ClientDisconnected
    return working.result()
