"""Hostile classes under load (issue 53): every POST route, with the request log on and off, answers each
hostile class with a 4xx in its protocol's shape, while `/health` keeps answering; afterwards the KV pages are
back to their baseline, the process's peak RSS grew little and the log by at most 64 KiB a refused request.

Loopback only, bounded: the unmarked tier sends each class once a route at a moderate size, just past each
bound it checks (a prompt whose body passes the 1 MiB the JSON worker decodes and whose text passes the context,
2,000 tools) in a few seconds, its two servers (log on, log off) sharing one model; the `slow` tier sends the
probe's sizes (10 MB prompts, 20,000 tools) one at a time and four at a time, cuts 16 streams before their first
byte and trickles 12 slow-loris sockets. Figures are printed (`-s`); the
bounds asserted are far from today's figures and far below what the probe saw before the fixes (a 14.5 s
`/health` stall, +1.6 GB a 10 MB prompt, 20 to 60 MB of log a refused body).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from health_probe import HealthProbe
from swarmkv import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.http.body import LARGE_BODY_BYTES
from swarmkv.server.observability.log_entry import MAX_REFUSED_LINE_BYTES

TIMEOUT_S = 120
USER = [{"role": "user", "content": "Hello"}]
JSON = {"content-type": "application/json"}
# Every POST route, with the field its prompt is written in (None: it has none).
PROMPT_FIELDS: dict[str, str | None] = {
    "/v1/chat/completions": "messages",
    "/v1/completions": "prompt",
    "/v1/messages": "messages",
    "/v1/messages/count_tokens": "messages",
    "/v1/responses": "input",
    "/v1/responses/input_tokens": "input",
    "/v1/cache/pin": "messages",
    "/v1/sessions/hostile/release": None,
}
GENERATING = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
# The issue's targets, one hostile body at a time against `swarmkv serve` (before the fixes: a 14.5 s /health
# stall, +1.6 GB a refused 10 MB prompt). /health's p99 target is 100 ms; the suite runs beside a second worker
# on two cores, where it measured 12 to 115 ms, so the assertion leaves room and the figure is printed.
TARGET_RSS_GROWTH_BYTES = 100 * 10**6
HEALTH_P99_MAX_S = 0.25
# Bounds far from today's figures, for what shares this process with the test or runs four at a time.
HEALTH_MAX_S = 1.0
RSS_GROWTH_PER_REQUEST_MAX_BYTES = 160 * 2**20


def _base(route: str) -> dict[str, Any]:
    if route.startswith("/v1/messages"):
        return {"messages": USER, "max_tokens": 2}
    if route.startswith("/v1/responses"):
        return {"input": "Hi", "max_output_tokens": 2}
    if route == "/v1/completions":
        return {"prompt": "Once", "max_tokens": 2}
    if route == "/v1/cache/pin":
        return {"messages": [{"role": "system", "content": "S"}], "ttl_s": 30}
    return {"messages": USER, "max_tokens": 2}


def _with_prompt(route: str, text: str) -> dict[str, Any]:
    body = _base(route)
    field = PROMPT_FIELDS[route]
    if field == "messages":
        body["messages"] = [{"role": "system" if route == "/v1/cache/pin" else "user", "content": text}]
    elif field is not None:
        body[field] = text
    return body


def _tools(route: str, num_tools: int) -> list[dict[str, Any]]:
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    if route.startswith("/v1/messages"):
        return [{"name": f"t{i}", "input_schema": schema} for i in range(num_tools)]
    if route.startswith("/v1/responses"):
        return [{"type": "function", "name": f"t{i}", "parameters": schema} for i in range(num_tools)]
    return [
        {"type": "function", "function": {"name": f"t{i}", "parameters": schema}} for i in range(num_tools)
    ]


Body = bytes | None  # None: the class does not apply to the route


def not_json(route: str) -> Body:
    return b'\xff{"messages": ['


def deep(route: str) -> Body:
    field = PROMPT_FIELDS[route] or "metadata"
    nested = "[" * 100_000 + "]" * 100_000
    return json.dumps({**_base(route), field: None}).replace("null", nested).encode()


def huge_prompt(num_chars: int) -> Callable[[str], Body]:
    def body(route: str) -> Body:
        if PROMPT_FIELDS[route] is None:
            return None
        return json.dumps(_with_prompt(route, "\U0001f600" * num_chars)).encode()

    return body


def many_tools(num_tools: int) -> Callable[[str], Body]:
    def body(route: str) -> Body:
        if route in ("/v1/completions", "/v1/sessions/hostile/release", "/v1/cache/pin"):
            return None
        return json.dumps({**_base(route), "tools": _tools(route, num_tools)}).encode()

    return body


def nan_sampling(route: str) -> Body:
    if route not in GENERATING:
        return None
    return json.dumps({**_base(route), "top_p": 0.5}).replace("0.5", "NaN").encode()


def out_of_vocabulary_bias(route: str) -> Body:
    if route not in ("/v1/chat/completions", "/v1/completions"):
        return None
    return json.dumps({**_base(route), "logit_bias": {"999999999": 5}}).encode()


@dataclass
class Served:
    url: str
    log: Path | None
    pid: int  # the server's process: this one in the unmarked tier, `swarmkv serve`'s in the slow tier

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def scripted_llm(scripted_model_dir: Path) -> LLM:
    """One model for both in-process servers, which run one after the other."""
    return LLM(str(scripted_model_dir), dtype="float32", kv_cache_memory="16MiB", max_num_seqs=4)


@pytest.fixture(scope="module", params=["log-on", "log-off"])
def served(
    request: pytest.FixtureRequest, scripted_llm: LLM, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """A server in this process (its threads share the test's lock and memory: sizes stay moderate)."""
    log = tmp_path_factory.mktemp("log") / "requests.jsonl" if request.param == "log-on" else None
    config = ServerConfig(log_requests=log, header_timeout_s=2.0, body_timeout_s=2.0)
    with BackgroundServer(create_app(scripted_llm, config), limits=config) as server:
        yield Served(server.url, log, os.getpid())


@pytest.fixture(scope="module", params=["log-on", "log-off"])
def serve_process(
    request: pytest.FixtureRequest, scripted_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Served]:
    """`swarmkv serve` in its own process, so /health's latency and the RSS are the server's alone."""
    folder = tmp_path_factory.mktemp("serve")
    log = folder / "requests.jsonl" if request.param == "log-on" else None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        str(Path(sys.executable).with_name("swarmkv")),
        "serve",
        "--model",
        str(scripted_model_dir),
        "--port",
        str(port),
    ]
    command += [
        "--dtype",
        "float32",
        "--kv-cache-memory",
        "16MiB",
        "--max-num-seqs",
        "4",
        "--log-level",
        "warning",
    ]
    command += ["--header-timeout-s", "2", "--body-timeout-s", "2"]
    command += ["--log-requests", str(log)] if log is not None else []
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=(folder / "stderr.txt").open("w"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert process.poll() is None, (folder / "stderr.txt").read_text()[-2000:]
            assert time.monotonic() < deadline, "swarmkv serve did not start"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield Served(url, log, process.pid)
    finally:
        process.terminate()
        process.wait(30)


def _rss_bytes(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _reset_peak_rss(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM back to the current RSS (Linux)


def _idle_pages(url: str, timeout_s: float = 60.0) -> int:
    """The KV pages in use once nothing runs or waits (or `timeout_s` passed), from /metrics."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{url}/metrics", timeout=TIMEOUT_S).text
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        busy = samples["swarmkv_requests_running"] + samples["swarmkv_requests_waiting"]
        if busy == 0 or time.monotonic() > deadline:
            return int(samples["swarmkv_kv_pages_in_use"])
        time.sleep(0.05)


def _check_shape(route: str, response: httpx.Response) -> None:
    assert 400 <= response.status_code < 500, (route, response.status_code, response.text[:300])
    body = response.json()
    if route.startswith("/v1/messages"):
        assert body["type"] == "error" and isinstance(body["error"]["message"], str), body
        assert isinstance(body["error"]["type"], str), body
    else:
        error = body["error"]
        assert isinstance(error["message"], str) and isinstance(error["type"], str), body
        assert set(error) >= {"message", "type", "param", "code"}, body


@dataclass
class ClassRun:
    name: str
    num_requests: int
    parallel: int
    health_p99_s: float
    health_worst_s: float
    rss_peak_growth_bytes: int
    rss_worst_route: str
    log_growth_bytes: int

    def line(self) -> str:
        return (
            f"{self.name}: {self.num_requests} requests {self.parallel} at a time, /health p99 "
            f"{1000 * self.health_p99_s:.0f} ms (worst {1000 * self.health_worst_s:.0f} ms), peak RSS "
            f"+{self.rss_peak_growth_bytes / 2**20:.0f} MiB ({self.rss_worst_route}), log +{self.log_growth_bytes} bytes"
        )


def run_class(
    served: Served, name: str, make: Callable[[str], Body], repeats: int = 1, parallel: int = 1
) -> ClassRun:
    """Send the class's body to every route it applies to, `repeats` times, `parallel` at a time, while
    /health is probed; check each answer's shape, then that the pages came back. The peak RSS growth is the
    largest of one request's (one at a time) or of the whole class's (several at a time)."""
    cases = [(route, body) for route in PROMPT_FIELDS for body in [make(route)] if body is not None] * repeats
    log_before = served.log.stat().st_size if served.log is not None and served.log.exists() else 0
    pages_before = _idle_pages(served.url)
    growths: list[tuple[int, str]] = []  # (peak RSS growth, the route or "all")

    def post(case: tuple[str, bytes]) -> tuple[str, httpx.Response]:
        route, body = case
        return route, httpx.post(f"{served.url}{route}", content=body, headers=JSON, timeout=TIMEOUT_S)

    def post_measured(case: tuple[str, bytes]) -> tuple[str, httpx.Response]:
        rss_before = _rss_bytes(served.pid, "VmRSS")
        _reset_peak_rss(served.pid)
        answer = post(case)
        growths.append((_rss_bytes(served.pid, "VmHWM") - rss_before, case[0]))
        return answer

    if parallel == 1:
        post(cases[0])  # once unmeasured: a route's first answer also makes what the server keeps (threads)
    with HealthProbe(served.url, interval_s=0.02, timeout_s=TIMEOUT_S) as probe:
        if parallel == 1:
            answers = [post_measured(case) for case in cases]
        else:
            rss_before = _rss_bytes(served.pid, "VmRSS")
            _reset_peak_rss(served.pid)
            with ThreadPoolExecutor(parallel) as pool:
                answers = list(pool.map(post, cases))
            growths.append((_rss_bytes(served.pid, "VmHWM") - rss_before, "all"))
    rss_growth, worst_route = max(growths)
    for route, response in answers:
        _check_shape(route, response)
    pages_after = _idle_pages(served.url)
    assert pages_after == pages_before, (name, pages_before, pages_after)
    log_after = served.log.stat().st_size if served.log is not None and served.log.exists() else 0
    run = ClassRun(
        name,
        len(cases),
        parallel,
        probe.p99_s,
        probe.worst_s,
        rss_growth,
        worst_route,
        log_after - log_before,
    )
    print(run.line())
    assert run.log_growth_bytes <= MAX_REFUSED_LINE_BYTES * len(cases), run.line()
    return run


CLASSES: dict[str, Callable[[str], Body]] = {
    "not JSON": not_json,
    "nested 100,000 deep": deep,
    # 100,000 emoji: a 1.2 MB body of escapes (past the JSON worker's 1 MiB), a prompt far past the context.
    "a prompt past the context in a body past 1 MiB": huge_prompt(100_000),
    "2,000 tools": many_tools(2_000),
    "NaN top_p": nan_sampling,
    "logit_bias outside the vocabulary": out_of_vocabulary_bias,
}


def test_the_moderate_prompt_is_decoded_by_the_json_worker_on_every_route() -> None:
    bodies = [huge_prompt(100_000)(route) for route in PROMPT_FIELDS]
    assert all(body is None or len(body) > LARGE_BODY_BYTES for body in bodies)


@pytest.mark.parametrize("name", list(CLASSES))
def test_each_hostile_class_is_a_4xx_on_every_route_and_leaves_nothing_behind(
    served: Served, name: str
) -> None:
    run_class(served, name, CLASSES[name])


PROBE_SIZES: dict[str, Callable[[str], Body]] = {
    "a 10 MB prompt": huge_prompt(2_500_000),
    "20,000 tools": many_tools(20_000),
    "nested 100,000 deep": deep,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROBE_SIZES))
def test_the_issues_targets_one_hostile_body_at_a_time(serve_process: Served, name: str) -> None:
    # /health's p99 over a few probes is its one slowest answer. Under `make test` the server shares 2 cores with
    # the other pytest worker and mypy, so its loop thread may wait for a core (549 ms once in a clean clone). A
    # stall of the server's own (a body handled on the loop) repeats in every run and a wait for a core does not,
    # so up to two more runs stand in before the bound fails; every run keeps the memory bound.
    runs = [run_class(serve_process, name, PROBE_SIZES[name])]
    while runs[-1].health_p99_s >= HEALTH_P99_MAX_S and len(runs) < 3:
        runs.append(run_class(serve_process, name, PROBE_SIZES[name]))
    lines = "; ".join(run.line() for run in runs)
    assert min(run.health_p99_s for run in runs) < HEALTH_P99_MAX_S, lines
    assert all(run.rss_peak_growth_bytes < TARGET_RSS_GROWTH_BYTES for run in runs), lines


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PROBE_SIZES))
def test_hostile_bodies_four_at_a_time_stall_nothing_for_long(serve_process: Served, name: str) -> None:
    run = run_class(serve_process, name, PROBE_SIZES[name], parallel=4)  # 5 to 8 routes: 4 at a time
    assert run.health_worst_s < HEALTH_MAX_S, run.line()
    assert run.rss_peak_growth_bytes < 4 * RSS_GROWTH_PER_REQUEST_MAX_BYTES, run.line()


def _send_and_cut(port: int, body: bytes) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = "POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        sock.sendall(f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
    # closed before reading a byte of the answer


@pytest.mark.slow
def test_16_streams_cut_before_their_first_byte_give_their_pages_back(serve_process: Served) -> None:
    served = serve_process
    start_pages = _idle_pages(served.url)
    with HealthProbe(served.url, interval_s=0.02, timeout_s=TIMEOUT_S) as probe:
        for i in range(16):
            text = f"{i} " + "a long prompt to prefill " * 80
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 200, "stream": True}
            _send_and_cut(served.port, json.dumps(body).encode())
        cut_s = time.monotonic()
        time.sleep(0.2)
        pages = _idle_pages(served.url, timeout_s=30)
    print(
        f"16 cut streams: pages back after {time.monotonic() - cut_s:.2f} s, /health worst {probe.worst_s:.3f} s"
    )
    assert pages == start_pages
    assert probe.worst_s < HEALTH_MAX_S


def _trickle(port: int, in_body: bool, closed_after_s: list[float]) -> None:
    start_s = time.monotonic()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            head + b"content-type: application/json\r\ncontent-length: 100\r\n\r\n" if in_body else head
        )
        sock.settimeout(0.5)
        while time.monotonic() - start_s < 10:
            try:
                if sock.recv(4096) == b"":
                    break
            except TimeoutError:
                pass
            except OSError:
                break
            try:
                sock.send(b" " if in_body else b"x")
            except OSError:
                break
    closed_after_s.append(time.monotonic() - start_s)


@pytest.mark.slow
def test_12_slow_loris_sockets_are_closed_at_their_deadline(served: Served) -> None:
    port = int(served.url.rsplit(":", 1)[1])
    closed_after_s: list[float] = []
    with HealthProbe(served.url, interval_s=0.02, timeout_s=TIMEOUT_S) as probe:
        threads = [
            threading.Thread(target=_trickle, args=(port, i % 2 == 1, closed_after_s)) for i in range(12)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    print(f"12 slow-loris sockets closed after {min(closed_after_s):.1f} to {max(closed_after_s):.1f} s")
    assert len(closed_after_s) == 12 and max(closed_after_s) < 5.0  # the deadlines are 2 s here
    assert probe.worst_s < HEALTH_MAX_S
