"""Run one HTTP request through an ASGI app in-process and stream its answer: the head, then body chunks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import ASGIApp, Message

# How long an app that already answered may take to notice the disconnect and return.
_WIND_DOWN_S = 5.0


async def call_asgi(
    app: ASGIApp, method: str, path: str, query: str, headers: tuple[tuple[str, str], ...], body: bytes
) -> AsyncIterator[tuple[int, tuple[tuple[str, str], ...]] | bytes]:
    """Yield (status, headers) once, then each non-empty body chunk; the app sees a disconnect if the
    caller stops early (e.g. its client went away), so a stream's request is aborted on the engine."""
    messages: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    sent_body = False

    async def receive() -> Message:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await messages.put(message)

    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": query.encode(),
        "root_path": "",
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
        "client": ("127.0.0.1", 0),
        "server": ("127.0.0.1", 80),
    }

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await messages.put(None)

    task = asyncio.create_task(run())
    try:
        while True:
            message = await messages.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                raw = message.get("headers", [])
                yield message["status"], tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in raw)
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if chunk:
                    yield chunk
                if not message.get("more_body", False):
                    break
        await task  # raises what the app raised, if it ended without answering
    finally:
        gone.set()
        if not task.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, _WIND_DOWN_S)
