"""The server's HTTP protocol (`server/http/protocol.py`): header and body deadlines, header bounds, keep-alive cap.

A small Starlette app behind `BackgroundServer` with short limits; raw sockets play the slow or oversized clients.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from swarmkv.server.background import BackgroundServer
from swarmkv.server.config import ServerConfig

LIMITS = ServerConfig(
    header_timeout_s=0.5,
    body_timeout_s=0.5,
    max_header_bytes=4096,
    max_headers=20,
    max_requests_per_connection=3,
)


async def echo(request: Request) -> JSONResponse:
    return JSONResponse({"bytes": len(await request.body())})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    app = Starlette(routes=[Route("/echo", echo, methods=["POST"])])
    with BackgroundServer(app, limits=LIMITS) as server:
        yield server.port


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a timeout fails the test)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)["error"]


def request(body: bytes = b"{}", headers: str = "") -> bytes:
    return f"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n{headers}\r\n".encode() + body


def test_a_complete_request_is_answered(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(request(b"[1, 2]", "connection: close\r\n"))
        answer = read_all(sock)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2]) == {"bytes": 6}


@pytest.mark.parametrize("part", ["nothing", "header", "body"])
def test_a_trickle_is_answered_408_and_closed(port: int, part: str) -> None:
    whole = request(b'{"a": 1}')
    sent = {"nothing": b"", "header": whole[:10], "body": whole[:-3]}[part]
    start_s = time.monotonic()
    with connect(port) as sock:
        sock.sendall(sent)
        for byte in whole[len(sent) : len(sent) + 3] if part != "nothing" else b"":
            time.sleep(0.2)  # a byte at a time, each well within any per-read timeout
            sock.send(bytes([byte]))
        answer = read_all(sock)
    elapsed_s = time.monotonic() - start_s
    assert elapsed_s < 2.0, elapsed_s
    status, error = status_and_error(answer)
    assert status == 408 and error["code"] == "request_timeout", answer
    assert ("body" if part == "body" else "header") in error["message"]


def test_too_many_headers_and_too_large_a_header_are_431(port: int) -> None:
    many = "".join(f"x-{i}: {i}\r\n" for i in range(30))
    for headers in (many, "x-big: " + "a" * 10_000 + "\r\n"):
        with connect(port) as sock:
            sock.sendall(request(headers=headers))
            status, error = status_and_error(read_all(sock))
        assert status == 431 and error["code"] == "request_header_fields_too_large", error


def test_a_large_header_sent_in_pieces_is_refused_before_it_ends(port: int) -> None:
    with connect(port) as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\nx-big: ")
        for _ in range(10):
            try:
                sock.sendall(b"a" * 1000)
            except OSError:
                break  # the server closed it: refused
        status, _ = status_and_error(read_all(sock))
    assert status == 431


def test_keep_alive_ends_after_max_requests_per_connection(port: int) -> None:
    with connect(port) as sock:
        answers = []
        for _ in range(LIMITS.max_requests_per_connection):
            sock.sendall(request())
            answers.append(sock.recv(65536))
        assert b"connection: close" not in answers[0].lower()
        assert b"connection: close" in answers[-1].lower()
        assert read_all(sock) == b""  # closed by the server
