"""Slow-loris clients against `swarmkv serve`'s HTTP protocol (issue 53): are their sockets closed, does /health answer?

Serves the embedded default model on loopback with the default limits (`ServerConfig`), times /health every
`--probe-interval-s` for `--baseline-s` with no other client (the same run's baseline), then opens N sockets that
trickle a byte every `--interval-s` (half of them in the header, half in the body, after a complete header
announcing a 1 KB body), and times /health meanwhile. Prints when the server closed each socket, what it
answered, and /health's latency percentiles with and without them.

    .venv/bin/python bench/slow_loris.py [--sockets 12] [--interval-s 2] [--duration-s 60]
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import httpx
import uvicorn
from starlette.types import ASGIApp

from swarmkv import LLM
from swarmkv.models.loader import load_model
from swarmkv.server import create_app
from swarmkv.server.background import BackgroundServer

HEADER_START = b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
BODY_HEAD = HEADER_START + b"content-type: application/json\r\ncontent-length: 1000\r\n\r\n"


def trickle(
    port: int, in_body: bool, interval_s: float, duration_s: float, closed: list[tuple[float, bytes]]
) -> None:
    """Send a byte every `interval_s` until the server closes the socket (or `duration_s` passes)."""
    start_s = time.monotonic()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(BODY_HEAD if in_body else HEADER_START)
        sock.settimeout(interval_s)
        answer = b""
        while time.monotonic() - start_s < duration_s:
            try:
                chunk = sock.recv(4096)
                if not chunk:
                    closed.append((time.monotonic() - start_s, answer))
                    return
                answer += chunk
            except TimeoutError:
                pass
            except OSError:  # reset: the server closed it while our bytes were in flight
                closed.append((time.monotonic() - start_s, answer))
                return
            try:
                sock.send(b"x" if not in_body else b" ")
            except OSError:
                closed.append((time.monotonic() - start_s, answer))
                return
    closed.append((float("inf"), b"still open"))


@contextlib.contextmanager
def plain_uvicorn(app: ASGIApp) -> Iterator[SimpleNamespace]:
    """uvicorn with its own httptools protocol and defaults, on a free loopback port: the server before."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http="httptools"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield SimpleNamespace(port=port, url=f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def health_latencies_ms(url: str, interval_s: float, keep_going: Callable[[], bool]) -> list[float]:
    """/health's latency every `interval_s` while `keep_going()`."""
    latencies_ms = []
    with httpx.Client(timeout=30) as client:
        while keep_going():
            start_s = time.perf_counter()
            assert client.get(f"{url}/health").status_code == 200
            latencies_ms.append(1000 * (time.perf_counter() - start_s))
            time.sleep(interval_s)
    return latencies_ms


def summary(latencies_ms: list[float]) -> tuple[str, float]:
    """A line of p50, p99 and max, and the p99."""
    ordered = sorted(latencies_ms)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    line = f"{len(ordered)} probes, p50 {statistics.median(ordered):.1f} ms, p99 {p99:.1f} ms, max {ordered[-1]:.1f} ms"
    return line, p99


def main() -> None:
    """Run the trickling sockets and /health's probe; print what happened."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sockets", type=int, default=12)
    parser.add_argument("--interval-s", type=float, default=2.0)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--probe-interval-s", type=float, default=0.1, help="between two /health probes")
    parser.add_argument("--baseline-s", type=float, default=10.0, help="/health alone, before the sockets")
    parser.add_argument(
        "--plain-uvicorn", action="store_true", help="serve with uvicorn's own protocol: the figure before"
    )
    args = parser.parse_args()
    app = create_app(LLM(loaded=load_model()))
    with plain_uvicorn(app) if args.plain_uvicorn else BackgroundServer(app) as server:
        baseline_end_s = time.monotonic() + args.baseline_s
        baseline_ms = health_latencies_ms(
            server.url, args.probe_interval_s, lambda: time.monotonic() < baseline_end_s
        )
        closed: dict[str, list[tuple[float, bytes]]] = {"header": [], "body": []}
        threads = [
            threading.Thread(
                target=trickle,
                args=(
                    server.port,
                    i % 2 == 1,
                    args.interval_s,
                    args.duration_s,
                    closed["body" if i % 2 else "header"],
                ),
            )
            for i in range(args.sockets)
        ]
        for thread in threads:
            thread.start()
        latencies_ms = health_latencies_ms(
            server.url, args.probe_interval_s, lambda: any(thread.is_alive() for thread in threads)
        )
        for thread in threads:
            thread.join()
    for part, ends in closed.items():
        shut = sorted(t for t, _ in ends if t != float("inf"))
        statuses = sorted(
            {answer.split(b" ")[1].decode() for _, answer in ends if answer.startswith(b"HTTP/")}
        )
        still_open = len(ends) - len(shut)
        span = f"closed after {shut[0]:.1f} to {shut[-1]:.1f} s" if shut else "none closed"
        print(
            f"{len(ends)} sockets trickling in the {part}: {span}, answered {statuses or 'nothing'}, "
            f"{still_open} still open after {args.duration_s:g} s"
        )
    base_line, base_p99 = summary(baseline_ms)
    line, p99 = summary(latencies_ms)
    print(f"/health alone (baseline, this run): {base_line}")
    print(f"/health meanwhile: {line}; p99 {p99 / base_p99:.1f}x the baseline's")


if __name__ == "__main__":
    main()
