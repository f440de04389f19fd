"""What keeps web pages off a keyless loopback server (issue 24's probe, items 5 and 6), one test per finding.

A browser may send any page's "simple" requests (a text/plain or form POST, a bodyless one) to 127.0.0.1, and
after DNS rebinding (the page's own name re-pointed at 127.0.0.1) read the answers. The probe created a pin
with a cross-site `text/plain` POST, had a form-encoded chat answered with `Host: evil.example`, found the
request log readable by every local user and /metrics open under `--api-key`. One live server over a tiny
random Qwen3 checkpoint answers as `swarmkv serve` does by default; other settings (a key, `--metrics-public`,
`--cors-origins`, `--allowed-hosts`) are apps over the same model called in-process, on routes that need no
engine loop.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from swarmkv.engine.llm import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.cli import config_warnings, register, server_config
from swarmkv.server.context import ServerContext
from swarmkv.server.observability.request_log import RequestLog
from tiny_models import make_tiny_checkpoint

KEY = "sekrit"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
MESSAGES = {"model": "tiny", **CHAT}
# At least one whole 16-token page, so that a pin of it would succeed.
PIN = {"messages": [{"role": "user", "content": " ".join(f"word{i}" for i in range(40))}]}
EVIL = "https://evil.example"


@dataclass(frozen=True)
class Served:
    url: str
    http: httpx.Client
    llm: LLM
    ctx: ServerContext
    log_path: Path

    def counts(self) -> tuple[int, int, int, int]:
        """What a request that ran would have changed: pins, prompt and pin tokens, and the log's lines."""
        stats = self.ctx.engine.call(lambda engine: engine.stats()).result(timeout=60)
        lines = len(self.log_path.read_text().splitlines())
        return stats["pins"], stats["prompt_tokens"], stats["pin_prompt_tokens"], lines


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("security") / "qwen3", "qwen3")
    log_path = tmp_path_factory.mktemp("logs") / "requests.jsonl"
    llm = LLM(str(folder), kv_cache_memory="8MiB", block_size=16, max_model_len=512)
    app = create_app(llm, ServerConfig(served_model_name="tiny", log_requests=log_path))
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        yield Served(server.url, http, llm, app.state.ctx, log_path)


def in_process(served: Served, **config: Any) -> TestClient:
    """An app over the served model with `config`, called in-process; its engine loop never starts, so only
    routes that need none (/metrics, /v1/models, preflights) answer. TestClient's own Host, `testserver`, is
    a name no server answers by default: the client names 127.0.0.1 instead."""
    app = create_app(served.llm, ServerConfig(served_model_name="tiny", **config))
    return TestClient(app, base_url="http://127.0.0.1:8000")


def test_a_cross_site_text_plain_post_is_a_415_and_creates_nothing(served: Served) -> None:
    before = served.counts()
    page = {"Origin": EVIL, "Content-Type": "text/plain;charset=UTF-8"}  # what fetch() sends for a string
    for path, body in (("/v1/cache/pin", PIN), ("/v1/chat/completions", CHAT), ("/v1/responses", CHAT)):
        response = served.http.post(path, content=json.dumps(body), headers=page)
        assert response.status_code == 415, response.text
        error = response.json()["error"]
        assert error["code"] == "unsupported_media_type"
        assert "application/json" in error["message"] and "curl -d" in error["message"]
    # Anthropic's route answers in Anthropic's shape.
    response = served.http.post("/v1/messages", content=json.dumps(MESSAGES), headers=page)
    assert response.status_code == 415
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"
    assert served.counts() == before  # no pin, no prompt, no request-log line


def test_a_form_encoded_or_untyped_chat_is_a_415(served: Served) -> None:
    before = served.counts()
    form = served.http.post("/v1/chat/completions", data={"messages": "hi"})  # what `curl -d` sends
    assert form.status_code == 415 and "x-www-form-urlencoded" in form.json()["error"]["message"]
    multipart = served.http.post("/v1/chat/completions", files={"messages": b"hi"})
    assert multipart.status_code == 415
    untyped = served.http.post("/v1/chat/completions", content=json.dumps(CHAT))  # fetch() of a Blob
    assert untyped.status_code == 415 and "none" in untyped.json()["error"]["message"]
    assert served.counts() == before
    for content_type in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.x+json"):
        typed = served.http.post(
            "/v1/chat/completions", content=json.dumps(CHAT), headers={"Content-Type": content_type}
        )
        assert typed.status_code == 200, (content_type, typed.text)
    # A bodyless POST (a session's release) needs no content type.
    assert served.http.post("/v1/sessions/nobody/release").status_code == 404


def test_a_foreign_host_on_a_loopback_server_is_a_400(served: Served) -> None:
    before = served.counts()
    rebound = {"Host": "evil.example"}
    chat = served.http.post("/v1/chat/completions", json=CHAT, headers=rebound)
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "host_not_allowed"
    assert "--allowed-hosts evil.example" in chat.json()["error"]["message"]
    messages = served.http.post("/v1/messages", json=MESSAGES, headers={"Host": "evil.example:8000"})
    assert messages.status_code == 400 and messages.json()["error"]["type"] == "invalid_request_error"
    for path in ("/v1/cache/tree", "/cache", "/metrics", "/health", "/v1/models"):
        assert served.http.get(path, headers=rebound).status_code == 400, path
    assert served.counts() == before
    for host in ("127.0.0.1.evil.example", "localhost.evil.example", "evil.example."):
        assert served.http.get("/v1/cache/tree", headers={"Host": host}).status_code == 400, host


def test_loopback_names_and_ip_addresses_answer_on_any_port(served: Served) -> None:
    hosts = ("localhost", "LocalHost:8000", "localhost.:1", "127.0.0.1", "127.0.0.1:9", "[::1]:8000", "::1")
    hosts += ("10.1.2.3:8000", "[fe80::1]")  # a page names an address only when it came from there
    for host in hosts:
        response = served.http.get("/v1/cache/tree", headers={"Host": host})
        assert response.status_code == 200, (host, response.text)
    # --allowed-hosts adds names (any port); '*' answers any.
    named = in_process(served, allowed_hosts="api.internal, Swarm.LAN")
    for host, status in (
        ("api.internal:443", 200),
        ("swarm.lan", 200),
        ("localhost", 200),
        ("evil.example", 400),
    ):
        assert named.get("/v1/models", headers={"Host": host}).status_code == status, host
    bound = in_process(served, host="gpu-box.lan")  # the --host name itself
    assert bound.get("/v1/models", headers={"Host": "gpu-box.lan:8000"}).status_code == 200
    assert in_process(served, allowed_hosts="*").get("/v1/models", headers={"Host": "x.y"}).status_code == 200


def test_no_cors_headers_unless_cors_origins_names_the_origin(served: Served) -> None:
    preflight = {"Origin": "http://app.example:3000", "Access-Control-Request-Method": "POST"}
    preflight["Access-Control-Request-Headers"] = "content-type, authorization"

    def cors_headers(response: httpx.Response) -> dict[str, str]:
        return {k: v for k, v in response.headers.items() if k.startswith("access-control-")}

    # Off by default: no preflight answered, no Access-Control-* header on any answer.
    assert served.http.options("/v1/chat/completions", headers=preflight).status_code == 405
    assert cors_headers(served.http.options("/v1/chat/completions", headers=preflight)) == {}
    assert cors_headers(served.http.get("/v1/models", headers={"Origin": "http://app.example:3000"})) == {}

    listed = in_process(served, cors_origins="http://app.example:3000", api_key=KEY)
    answered = listed.options("/v1/chat/completions", headers=preflight)
    assert answered.status_code == 200
    assert cors_headers(answered)["access-control-allow-origin"] == "http://app.example:3000"
    assert "POST" in cors_headers(answered)["access-control-allow-methods"]
    assert "authorization" in cors_headers(answered)["access-control-allow-headers"]
    page = {"Origin": "http://app.example:3000", "Authorization": f"Bearer {KEY}"}
    models = listed.get("/v1/models", headers=page)
    assert models.status_code == 200
    assert models.headers["access-control-allow-origin"] == "http://app.example:3000"
    # The page may read a refusal too (a wrong key), so it can tell its user why.
    refused = listed.get("/v1/models", headers={"Origin": "http://app.example:3000"})
    assert refused.status_code == 401 and "access-control-allow-origin" in refused.headers
    # Another origin gets no CORS header at all, neither on its preflight nor on its answers.
    other = {**preflight, "Origin": EVIL}
    assert listed.options("/v1/chat/completions", headers=other).status_code == 400
    assert cors_headers(listed.options("/v1/chat/completions", headers=other)) == {}
    assert cors_headers(listed.get("/v1/models", headers={**page, "Origin": EVIL})) == {}
    anyone = in_process(served, cors_origins="*").options("/v1/models", headers=other)
    assert anyone.headers["access-control-allow-origin"] == "*"


def test_a_bodyless_write_from_another_sites_page_is_a_403(served: Served) -> None:
    release = "/v1/sessions/nobody/release"
    foreign = served.http.post(release, headers={"Origin": EVIL})
    assert foreign.status_code == 403 and foreign.json()["error"]["code"] == "origin_not_allowed"
    assert served.http.post(release, headers={"Origin": "null"}).status_code == 403  # a sandboxed page
    assert served.http.post(release, headers={"Origin": "http://[::1"}).status_code == 403  # no URL
    assert served.http.delete("/v1/responses/resp_x", headers={"Origin": EVIL}).status_code == 403
    # The server's own pages (its /cache page) and clients that are no page (no Origin) go on.
    assert served.http.post(release, headers={"Origin": served.url}).status_code == 404
    assert served.http.get("/v1/cache/tree", headers={"Origin": EVIL}).status_code == 200  # unreadable there


def test_the_request_log_is_created_readable_by_its_owner_only(
    served: Served, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert served.http.post("/v1/chat/completions", json=CHAT).status_code == 200
    assert stat.S_IMODE(served.log_path.stat().st_mode) == 0o600
    # An existing file keeps its mode (an owner's choice), with a warning when others may read it.
    logger = logging.getLogger("swarmkv.server.observability.request_log")
    logger.addHandler(caplog.handler)
    try:
        shared = tmp_path / "shared.jsonl"
        shared.touch()
        os.chmod(shared, 0o644)
        RequestLog(shared).close()
        assert stat.S_IMODE(shared.stat().st_mode) == 0o644
        assert any("other users can read it" in r.getMessage() for r in caplog.records)
    finally:
        logger.removeHandler(caplog.handler)


def test_metrics_need_the_key_unless_metrics_public(served: Served) -> None:
    keyed = in_process(served, api_key=KEY)
    refused = keyed.get("/metrics")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    assert keyed.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert keyed.get("/metrics", headers={"x-api-key": KEY}).status_code == 200
    assert keyed.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    public = in_process(served, api_key=KEY, metrics_public=True)
    assert public.get("/metrics").status_code == 200
    assert public.get("/v1/models").status_code == 401  # the API itself still needs the key
    assert served.http.get("/metrics").status_code == 200  # no key set: nothing to ask for


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_the_flags_and_the_start_warnings() -> None:
    flags = ("--allowed-hosts", "a.lan,b", "--cors-origins", "http://x:1", "--metrics-public")
    config = server_config(_serve_args(*flags))
    assert (config.allowed_hosts, config.cors_origins, config.metrics_public) == (
        "a.lan,b",
        "http://x:1",
        True,
    )
    assert config.allowed_host_names == frozenset(("a.lan", "b", "127.0.0.1"))
    assert not server_config(_serve_args()).metrics_public
    for flag, value in (
        ("--allowed-hosts", "http://a.lan"),
        ("--allowed-hosts", "a.lan:8000"),
        ("--allowed-hosts", "a,,b"),
        ("--cors-origins", "http://x:1/"),
        ("--cors-origins", "app.example"),
    ):
        with pytest.raises(ValueError, match=flag):
            server_config(_serve_args(flag, value))
    assert config_warnings(ServerConfig()) == []
    (open_port,) = config_warnings(ServerConfig(host="0.0.0.0"))
    assert "0.0.0.0 without --api-key" in open_port
    assert len(config_warnings(ServerConfig(cors_origins="*", allowed_hosts="*"))) == 2
    assert config_warnings(ServerConfig(host="0.0.0.0", api_key=KEY, cors_origins="*")) == []
