"""Hostile bodies against a live `swarmkv serve` (issue 53, items 1 to 4): time to the 400 and the slowest
`/health` answer meanwhile, the server's peak RSS growth and the request log's growth per refused body.

Starts `swarmkv serve` on the embedded default model (SmolLM2, 8,192-token context) in a subprocess with
`--log-requests`, warms it with one refusal of each kind, then for each case resets the server's peak RSS
(`/proc/PID/clear_refs`), sends the body while a thread polls `/health` every 10 ms, and prints one line:

    .venv/bin/python bench/hostile.py [--model PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

JSON = {"content-type": "application/json"}
EMOJI_10MB = "\U0001f600" * 2_500_000


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


class HealthPoller:
    """Polls /health every 10 ms on a thread; the slowest answer while it ran."""

    def __init__(self, url: str) -> None:
        self.url, self.latencies_s, self._stop = url, [0.0], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                client.get(f"{self.url}/health")
                self.latencies_s.append(time.perf_counter() - start)
                time.sleep(0.01)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    """Serve, send each hostile body, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="HF directory or GGUF file (default: the embedded SmolLM2)"
    )
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="swarmkv-hostile-"))
    log = folder / "requests.jsonl"
    port = _free_port()
    command = [
        str(Path(sys.executable).with_name("swarmkv")),
        "serve",
        "--port",
        str(port),
        "--log-requests",
        str(log),
    ]
    command += ["--model", args.model] if args.model else []
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        tools = [
            {"type": "function", "name": f"t{i}", "parameters": {"type": "object"}} for i in range(20_000)
        ]
        chat = {"messages": [{"role": "user", "content": EMOJI_10MB}], "max_tokens": 2}
        cases = [
            ("20,000 tools on /v1/responses", "/v1/responses", json.dumps({"input": "hi", "tools": tools})),
            (
                "20,000 tools on /v1/responses/input_tokens",
                "/v1/responses/input_tokens",
                json.dumps({"input": "hi", "tools": tools}),
            ),
            ("10 MB emoji chat", "/v1/chat/completions", json.dumps(chat)),
            (
                "10 MB emoji count_tokens",
                "/v1/messages/count_tokens",
                json.dumps({"messages": chat["messages"]}),
            ),
            ("nested 100,000 deep, chat", "/v1/chat/completions", "[" * 100_000),
            ("nested 100,000 deep, messages", "/v1/messages", "[" * 100_000),
        ]
        raws = [(name, route, raw.encode()) for name, route, raw in cases]
        for _, route, raw in raws:  # warm: first-use allocations are not the request's
            httpx.post(f"{url}{route}", content=raw, headers=JSON, timeout=120)
        print(
            f"{'case':44} {'status':>6} {'to 400 s':>9} {'/health max ms':>15} {'peak RSS +MB':>13} {'log +B':>8}"
        )
        for name, route, raw in raws:
            Path(f"/proc/{server.pid}/clear_refs").write_text("5")  # the peak RSS restarts from now
            rss_kib = _kib(server.pid, "VmRSS")
            log_bytes = log.stat().st_size if log.exists() else 0
            with HealthPoller(url) as poller:
                time.sleep(0.1)
                start = time.perf_counter()
                response = httpx.post(f"{url}{route}", content=raw, headers=JSON, timeout=120)
                took_s = time.perf_counter() - start
                time.sleep(0.1)
            grown_mb = (_kib(server.pid, "VmHWM") - rss_kib) / 1024
            logged = (log.stat().st_size if log.exists() else 0) - log_bytes
            stall_ms = max(poller.latencies_s) * 1000
            print(
                f"{name:44} {response.status_code:>6} {took_s:>9.3f} {stall_ms:>15.1f} {grown_mb:>13.1f} {logged:>8}"
            )
    finally:
        server.terminate()
        server.wait(timeout=30)
        for path in folder.iterdir():
            os.unlink(path)
        folder.rmdir()


if __name__ == "__main__":
    main()
