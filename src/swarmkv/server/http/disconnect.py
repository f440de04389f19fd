"""Run a request's work until it is done or its client disconnects, whichever comes first."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")

# nginx's "client closed request": logged and counted, never seen by the client.
STATUS_CLIENT_GONE = 499


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
