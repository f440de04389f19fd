"""The server's HTTP/1.1 protocol: uvicorn's httptools protocol with limits uvicorn lacks (issue 53).

uvicorn bounds neither the time a request's header or body may take to arrive nor the header's size and
count, so a client trickling a byte every few seconds holds a socket (and a task) for as long as it likes,
and one 200 KB header or 5,000 headers are parsed and kept. `GuardedHttpProtocol` adds, per connection:

- a deadline for the whole request line and headers, from the connection's opening or the request's first
  byte (`--header-timeout-s`): past it, a 408 and the connection closed;
- a deadline for the whole body once the headers are in (`--body-timeout-s`): past it, a 408 if no answer
  has started, the route sees a disconnect, and the connection is closed;
- the header's bytes and count (`--max-header-bytes`, `--max-headers`): past either, a 431 and a close;
- at most `--max-requests-per-connection` requests on one keep-alive connection, whose idle time between
  requests uvicorn bounds (`--keep-alive-timeout-s`).

Each refusal carries the OpenAI error shape. Ray Serve's replicas (`serve --replicas`) have their own proxy.
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from swarmkv.api.errors import APIError
from swarmkv.api.messages_objects import anthropic_error
from swarmkv.api.paths import is_messages_route
from swarmkv.server.config import ServerConfig


class _Refused(Exception):
    """Stops the parser inside a callback; the protocol has already chosen its answer."""


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with header and body deadlines, header bounds and a keep-alive cap."""

    def __init__(self, *args: Any, limits: ServerConfig, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        # Between a request's start (or the connection's) and its headers' end, bytes count against the cap.
        self._in_head = True
        self._head_bytes = 0  # read while in the head: bounds what the parser buffers of a head not yet whole
        self._parsed_head_bytes = 0  # of the request line and headers parsed
        self._num_headers = 0
        self._num_requests = 0
        self._refusal: APIError | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, "header")  # a connection that never sends is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None:
            return  # answered and closing: the rest is not read
        if self._in_head:
            self._head_bytes += len(data)
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            if self._refusal is None:  # a malformed request, not one of ours
                self.logger.warning("Invalid HTTP request received.")
                self.send_400_response("Invalid HTTP request received.")
            else:
                self._answer_and_close(self._refusal)
            return
        if self._in_head and self._head_bytes > self.limits.max_header_bytes:
            self._answer_and_close(self._header_too_large())

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self._num_headers = 0
        self._parsed_head_bytes = 0
        if self._deadline is None:  # the first request's deadline runs from the connection's opening
            self._arm(self.limits.header_timeout_s, "header")

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._num_headers += 1
        if self._num_headers > self.limits.max_headers:
            self._refusal = _too_large(f"the request has more than {self.limits.max_headers} header fields")
            raise _Refused
        self._count_head(len(name) + len(value) + 4)  # with ": " and CRLF
        super().on_header(name, value)

    def _count_head(self, num_bytes: int) -> None:
        """Count parsed header bytes: a head that arrived whole in one read is checked here."""
        self._parsed_head_bytes += num_bytes
        if self._parsed_head_bytes > self.limits.max_header_bytes:
            self._refusal = self._header_too_large()
            raise _Refused

    def _header_too_large(self) -> APIError:
        return _too_large(f"the request's header is over {self.limits.max_header_bytes} bytes")

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._num_requests += 1
        super().on_headers_complete()
        if self._num_requests >= self.limits.max_requests_per_connection and self.cycle is not None:
            self.cycle.keep_alive = False  # its answer says `connection: close`
        self._arm(self.limits.body_timeout_s, "body")

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _arm(self, timeout_s: float, part: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(timeout_s, self._expire, part, timeout_s)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, part: str, timeout_s: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        error = APIError(
            408, f"the request's {part} did not arrive within {timeout_s:g} s", code="request_timeout"
        )
        self._answer_and_close(error)

    def _answer_and_close(self, error: APIError) -> None:
        """Answer `error` unless an answer has started, tell a running route its client left, and close."""
        self._refusal = error
        self._disarm()
        cycle = self.cycle
        running = cycle is not None and not cycle.response_complete
        if cycle is not None and running:
            # The route (reading its body) sees a disconnect, and its own answer goes nowhere.
            cycle.disconnected = True
            cycle.message_event.set()
        if not (running and cycle is not None and cycle.response_started):
            path = self.scope.get("path", "") if self.scope is not None else ""
            self.transport.write(_response_bytes(error, path, self.server_state.default_headers))
        self.transport.close()


def _too_large(message: str) -> APIError:
    return APIError(431, message, code="request_header_fields_too_large")


def _response_bytes(error: APIError, path: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """The whole answer: `error` in its route's shape (Anthropic's on /v1/messages), then the close."""
    status, shaped = anthropic_error(error) if is_messages_route(path) else (error.status, error.to_json())
    body = json.dumps(shaped).encode()
    head = [STATUS_LINE[status]]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [
        b"content-type: application/json\r\n",
        b"content-length: " + str(len(body)).encode() + b"\r\n",
        b"connection: close\r\n\r\n",
    ]
    return b"".join(head) + body


def uvicorn_options(config: ServerConfig) -> dict[str, Any]:
    """The `uvicorn.run`/`uvicorn.Config` settings that carry `config`'s HTTP limits."""
    return {
        "http": functools.partial(GuardedHttpProtocol, limits=config),
        "timeout_keep_alive": config.keep_alive_timeout_s,
    }
