"""The server's error paths (issue 53): a prompt of exactly the context's length is a 400 on the count routes as
on the generating ones, an unexpected failure is a 500 in the route's error shape, and a request log that
cannot be written never changes an answer; the end of a request is logged off the event loop."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from swarmkv import LLM
from swarmkv.models.loader import load_model
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.observability.request_log import RequestLog
from swarmkv.server.routes import chat, messages

MAX_MODEL_LEN = 96
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def url(scripted_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    loaded = load_model(scripted_model_dir, dtype="float32")
    llm = LLM(loaded=loaded, kv_cache_memory="8MiB", max_num_seqs=2, max_model_len=MAX_MODEL_LEN)
    log = tmp_path_factory.mktemp("errors") / "requests.jsonl"
    with BackgroundServer(create_app(llm, ServerConfig(log_requests=log))) as server:
        yield server.url


def post(url: str, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{route}", content=json.dumps(body).encode(), headers=JSON, timeout=60)


def _user(text: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": text}]}


def _count(url: str, text: str) -> httpx.Response:
    return post(url, "/v1/messages/count_tokens", _user(text))


def test_a_prompt_of_exactly_the_context_is_refused_by_counting_and_generating_alike(url: str) -> None:
    # The length in characters whose prompt is one token short of the context: a byte-level vocabulary, so
    # each further character is one token (checked).
    base = _count(url, "a").json()["input_tokens"]
    assert _count(url, "ab").json()["input_tokens"] == base + 1
    short = "ab" * MAX_MODEL_LEN
    fits = short[: MAX_MODEL_LEN - base]  # MAX_MODEL_LEN - 1 tokens
    exact = short[: MAX_MODEL_LEN - base + 1]  # MAX_MODEL_LEN tokens: no room for a reply
    assert _count(url, fits).json()["input_tokens"] == MAX_MODEL_LEN - 1
    chat_fits = post(url, "/v1/messages", {**_user(fits), "max_tokens": 1})
    assert chat_fits.status_code == 200, chat_fits.text
    for route, body in (
        ("/v1/messages/count_tokens", _user(exact)),
        ("/v1/messages", {**_user(exact), "max_tokens": 1}),
        ("/v1/chat/completions", {**_user(exact), "max_tokens": 1}),
    ):
        refused = post(url, route, body)
        assert refused.status_code == 400, (route, refused.text)
        assert f"has {MAX_MODEL_LEN};" in refused.json()["error"]["message"], (route, refused.text)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_an_unexpected_failure_is_a_500_in_the_routes_shape(
    url: str, route: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug, with a secret in its message")

    monkeypatch.setattr(chat, "parse_chat_request", broken)
    monkeypatch.setattr(messages, "parse_messages_request", broken)
    with caplog.at_level(logging.ERROR, logger="swarmkv.server.http.errors"):
        answer = post(url, route, {**_user("Hi"), "max_tokens": 2})
    assert answer.status_code == 500
    assert "secret" not in answer.text  # says no more than that it failed
    if route == "/v1/messages":
        assert answer.json()["type"] == "error" and answer.json()["error"]["type"] == "api_error"
    else:
        assert answer.json()["error"]["type"] == "server_error"
    assert any("unhandled error on " + route in record.getMessage() for record in caplog.records)


def _full_disk(*args: Any, **kwargs: Any) -> None:
    raise OSError(28, "No space left on device")


def test_a_refusal_the_log_cannot_record_is_still_its_400(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RequestLog, "write_refused", _full_disk)
    answer = post(url, "/v1/chat/completions", {"messages": "not a list"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages", answer.text


def test_a_request_the_log_cannot_record_is_still_answered(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(RequestLog, "write", _full_disk)
    monkeypatch.setattr(RequestLog, "write_ended", _full_disk)
    answer = post(url, "/v1/chat/completions", {**_user("Hi"), "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_requests_end_is_logged_off_the_event_loop(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    written: dict[str, bool] = {}  # request id -> whether its end was written on the event loop
    wrote = threading.Condition()

    def write_ended(self: RequestLog, request_id: str, *counts: int) -> None:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        with wrote:
            written[request_id] = on_loop
            wrote.notify_all()

    monkeypatch.setattr(RequestLog, "write_ended", write_ended)
    answer = post(url, "/v1/chat/completions", {**_user("Hi"), "max_tokens": 2})
    assert answer.status_code == 200
    request_id = answer.json()["id"]
    with wrote:  # an earlier test's request may end here too, late under load: this one's end is awaited
        assert wrote.wait_for(lambda: request_id in written, timeout=30)
    assert written[request_id] is False and not any(written.values())
