"""A request whose client leaves is cancelled at once, and what it handed the engine is aborted
(`server/http/disconnect.py`), before its answer's first byte as well as during a stream."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from swarmkv.server.background import BackgroundServer
from swarmkv.server.http.disconnect import CancelOnDisconnect, submitted


class Recorder:
    """What the routes and the middleware did, read from the test's thread."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.cancelled: list[str] = []
        self.lock = threading.Lock()

    def abort(self, request_id: str) -> None:
        with self.lock:
            self.aborted.append(request_id)


RECORD = Recorder()


async def waits_before_answering(request: Request) -> Response:
    """Reads its body, hands the engine a request, then waits (a prefill) before its first byte."""
    name = json.loads(await request.body())["name"]
    ids = submitted(request.scope)
    assert ids is not None
    ids.append(name)
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        RECORD.cancelled.append(name)
        raise
    return Response("never")


async def streams_slowly(request: Request) -> Response:
    name = json.loads(await request.body())["name"]
    ids = submitted(request.scope)
    assert ids is not None
    ids.append(name)

    async def events() -> AsyncIterator[str]:
        yield "data: first\n\n"
        await asyncio.sleep(3600)
        yield "data: never\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    routes = [
        Route("/wait", waits_before_answering, methods=["POST"]),
        Route("/stream", streams_slowly, methods=["POST"]),
    ]
    app = Starlette(routes=routes, middleware=[Middleware(CancelOnDisconnect, abort=RECORD.abort)])
    with BackgroundServer(app) as server:
        yield server.port


def cut(port: int, path: str, name: str, read_first: bool) -> None:
    body = json.dumps({"name": name}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body
        )
        if read_first:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        else:
            time.sleep(0.2)  # the route is waiting by now


def wait_for(names: list[str], seen: list[str], timeout_s: float = 1.0) -> float:
    start_s = time.monotonic()
    while not set(names) <= set(seen):
        assert time.monotonic() - start_s < timeout_s, (names, seen)
        time.sleep(0.01)
    return time.monotonic() - start_s


def test_a_request_cut_before_its_first_byte_is_cancelled_and_aborted_within_a_second(port: int) -> None:
    names = [f"before-{i}" for i in range(8)]
    for name in names:
        cut(port, "/wait", name, read_first=False)
    wait_for(names, RECORD.aborted)
    wait_for(names, RECORD.cancelled)


def test_a_stream_cut_after_its_first_byte_is_aborted_within_a_second(port: int) -> None:
    names = [f"stream-{i}" for i in range(4)]
    for name in names:
        cut(port, "/stream", name, read_first=True)
    wait_for(names, RECORD.aborted)
