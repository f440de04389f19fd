"""Serve an ASGI app with uvicorn on a free loopback port in a background thread (tests, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from starlette.types import ASGIApp

from swarmkv.server.config import ServerConfig
from swarmkv.server.http.protocol import uvicorn_options


class BackgroundServer:
    """`with BackgroundServer(app) as server:` serves `app` at `server.url` until the block ends."""

    def __init__(
        self,
        app: ASGIApp,
        host: str = "127.0.0.1",
        startup_timeout_s: float = 30.0,
        limits: ServerConfig | None = None,
    ) -> None:
        """`limits`: the config whose HTTP limits the server keeps (None: the defaults)."""
        self.host = host
        self._startup_timeout_s = startup_timeout_s
        # Bound here, before uvicorn starts, so the port is known and cannot be taken in between.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.port: int = self._socket.getsockname()[1]
        http = uvicorn_options(limits if limits is not None else ServerConfig())
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5, **http)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [self._socket]},
            name=f"uvicorn-{self.port}",
            daemon=True,
        )

    @property
    def url(self) -> str:
        """Base URL, without a trailing slash."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        """Start serving; returns once uvicorn accepts connections."""
        self._thread.start()
        deadline = time.monotonic() + self._startup_timeout_s
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during startup (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {self._startup_timeout_s} s")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask uvicorn to exit and wait for the thread."""
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
