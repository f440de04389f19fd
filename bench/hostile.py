"""Hostile bodies against a live `swarmkv serve` (issue 53, items 1 to 4): time to the 400 and `/health`'s
latency meanwhile, against its latency with no hostile load in the same run; the server's peak RSS growth
and its body-decoding worker's peak RSS (a child process), and the request log's growth per refused body.

Starts `swarmkv serve` on the embedded default model (SmolLM2, 8,192-token context) in a subprocess with
`--log-requests`, warms it with one refusal of each kind, then times `/health` every 10 ms for `--baseline-s`
with nothing else sent (the baseline), sends each case's body `--repeats` times while a thread keeps timing
`/health`, and times the baseline again at the end (both baselines pooled). Per case it prints `/health`'s
p50, p99 and slowest answer, and p99 over the baseline's p99. The peak RSS is reset before each request
(`/proc/PID/clear_refs`) and the largest growth is shown; the worker's is its whole peak (it keeps what its
allocator kept from the body before):

    .venv/bin/python bench/hostile.py [--model PATH] [--repeats 5] [--cases emoji,stops]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
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
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except FileNotFoundError:  # a child that has exited
        return 0
    return next((int(line.split()[1]) for line in lines if line.startswith(field + ":")), 0)


def _children(pid: int) -> list[int]:
    """The server's child processes (its body-decoding worker, once started)."""
    # Per thread: the worker is started from whichever thread decoded the first large body.
    tasks = Path(f"/proc/{pid}/task").iterdir()
    return [int(child) for task in tasks for child in (task / "children").read_text().split()]


def _reset_peaks(pids: list[int]) -> None:
    for pid in pids:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM restarts from the RSS now


class HealthPoller:
    """Times /health every 10 ms on a thread while its block runs."""

    def __init__(self, url: str) -> None:
        self.url, self._stop = url, threading.Event()
        self.latencies_s: list[float] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                start = time.perf_counter()
                assert client.get(f"{self.url}/health").status_code == 200
                self.latencies_s.append(time.perf_counter() - start)
                self._stop.wait(0.01)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def percentile_ms(latencies_s: list[float], q: float) -> float:
    """The `q` quantile of `latencies_s` (nearest rank), in milliseconds."""
    ordered = sorted(latencies_s)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def cases() -> list[tuple[str, str, bytes]]:
    """(name, route, body) of each hostile case."""
    tools = [{"type": "function", "name": f"t{i}", "parameters": {"type": "object"}} for i in range(20_000)]
    chat = {"messages": [{"role": "user", "content": EMOJI_10MB}], "max_tokens": 2}
    stops = {"messages": [{"role": "user", "content": "Hi"}], "stop": ["a"] * 7_500_000}
    listed = [
        ("20,000 tools on /v1/responses", "/v1/responses", json.dumps({"input": "hi", "tools": tools})),
        (
            "20,000 tools on /v1/responses/input_tokens",
            "/v1/responses/input_tokens",
            json.dumps({"input": "hi", "tools": tools}),
        ),
        ("10 MB emoji chat (30 MB of escapes)", "/v1/chat/completions", json.dumps(chat)),
        ("10 MB emoji chat (UTF-8)", "/v1/chat/completions", json.dumps(chat, ensure_ascii=False)),
        (
            "10 MB emoji count_tokens",
            "/v1/messages/count_tokens",
            json.dumps({"messages": chat["messages"]}),
        ),
        (
            "7,500,000 stops (30 MB), chat",
            "/v1/chat/completions",
            json.dumps(stops, separators=(",", ":")),
        ),
        ("nested 100,000 deep, chat", "/v1/chat/completions", "[" * 100_000),
        ("nested 100,000 deep, messages", "/v1/messages", "[" * 100_000),
    ]
    return [(name, route, raw.encode()) for name, route, raw in listed]


def main() -> None:
    """Serve, time the baseline, send each hostile body, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="HF directory or GGUF file (default: the embedded SmolLM2)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="times each case's body is sent")
    parser.add_argument("--baseline-s", type=float, default=3.0, help="each no-load window, at start and end")
    parser.add_argument("--cases", default="", help="comma-separated words; only cases whose name holds one")
    args = parser.parse_args()
    words = [word.strip().lower() for word in args.cases.split(",") if word.strip()]
    chosen = [case for case in cases() if not words or any(word in case[0].lower() for word in words)]
    folder = Path(tempfile.mkdtemp(prefix="swarmkv-hostile-"))
    log = folder / "requests.jsonl"
    port = _free_port()
    command = [str(Path(sys.executable).with_name("swarmkv")), "serve", "--port", str(port)]
    command += ["--log-requests", str(log)] + (["--model", args.model] if args.model else [])
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline_s = time.monotonic() + 600  # a loaded machine takes minutes to load the model
        while time.monotonic() < deadline_s and server.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        # Warm: what a route's first answer makes (threads, the decoding worker) is not the case's.
        for _, route, raw in chosen:
            httpx.post(f"{url}{route}", content=raw, headers=JSON, timeout=600)
        baseline_s: list[float] = []
        with HealthPoller(url) as poller:
            time.sleep(args.baseline_s)
        baseline_s += poller.latencies_s
        rows = []
        for name, route, raw in chosen:
            statuses: set[str] = set()
            took_s, grown_mb, worker_mb, logged = [], [], [], []
            with HealthPoller(url) as poller:
                for _ in range(args.repeats):
                    workers = _children(server.pid)
                    _reset_peaks([server.pid, *workers])
                    rss_kib = _kib(server.pid, "VmRSS")
                    log_bytes = log.stat().st_size if log.exists() else 0
                    time.sleep(0.1)
                    start = time.perf_counter()
                    try:
                        response = httpx.post(f"{url}{route}", content=raw, headers=JSON, timeout=600)
                        statuses.add(str(response.status_code))
                    except httpx.HTTPError:  # the connection closed without an answer: shown as "cut"
                        statuses.add("cut")
                    took_s.append(time.perf_counter() - start)
                    time.sleep(0.1)
                    grown_mb.append((_kib(server.pid, "VmHWM") - rss_kib) / 1024)
                    worker_mb.append(sum(_kib(pid, "VmHWM") for pid in workers) / 1024)
                    logged.append((log.stat().st_size if log.exists() else 0) - log_bytes)
            rows.append((name, statuses, took_s, poller.latencies_s, grown_mb, worker_mb, logged))
            print(f"{name}: done", file=sys.stderr, flush=True)
        with HealthPoller(url) as poller:
            time.sleep(args.baseline_s)
        baseline_s += poller.latencies_s
    finally:
        server.terminate()
        server.wait(timeout=30)
        for path in folder.iterdir():
            os.unlink(path)
        folder.rmdir()
    base_p99 = percentile_ms(baseline_s, 0.99)
    print(
        f"baseline (no hostile load, {len(baseline_s)} probes): /health p50 {percentile_ms(baseline_s, 0.5):.1f} "
        f"ms, p99 {base_p99:.1f} ms, max {1000 * max(baseline_s):.1f} ms; each case sent {args.repeats} times"
    )
    print(
        f"{'case':42} {'status':>6} {'to 400 s':>8} {'/health p50':>11} {'p99 ms':>7} {'max ms':>7} "
        f"{'p99/base':>8} {'RSS +MB':>8} {'worker MB':>10} {'log +B':>7}"
    )
    for name, statuses, took_s, latencies_s, grown_mb, worker_mb, logged in rows:
        p99 = percentile_ms(latencies_s, 0.99)
        print(
            f"{name:42} {'/'.join(sorted(statuses)):>6} {statistics.median(took_s):>8.3f} "
            f"{percentile_ms(latencies_s, 0.5):>11.1f} {p99:>7.1f} {1000 * max(latencies_s):>7.1f} "
            f"{p99 / base_p99:>8.1f} {max(grown_mb):>8.1f} {max(worker_mb):>10.1f} "
            f"{int(statistics.median(logged)):>7}"
        )


if __name__ == "__main__":
    main()
