"""Sessions and pins over HTTP: session ids on generation requests, releasing sessions, pinning prefixes.

One server over a tiny random Qwen3 checkpoint (the real Qwen3 tokenizer and chat template, so chat
messages and tools render as they would for a real model) serves the module. Every bad request gets an
OpenAI-shaped 4xx, and the next completion still succeeds.
"""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import openai
import pytest

from swarmkv.api.errors import APIError
from swarmkv.api.pin_request import parse_pin_request
from swarmkv.api.session_id import resolve_session_id
from swarmkv.core.pins import PinInfo
from swarmkv.engine.llm import LLM
from swarmkv.engine.output_processor import RequestDelta
from swarmkv.errors import PinLimitError
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext
from swarmkv.server.engine_loop.commands import AddPin
from swarmkv.server.engine_loop.pending_pins import PendingPins
from swarmkv.server.engine_loop.request_stream import EngineStepError, EngineUnavailableError
from tiny_models import make_tiny_checkpoint

BLOCK = 16
NUM_PAGES = 96
PIN_CAP_PAGES = 24
SYSTEM = (
    "You are one agent of a swarm that maintains a large Python repository. Read the task, call the tools "
    "you need, and answer with a short summary of what you changed and why."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite, or the tests matching a pattern",
            "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}},
        },
    },
]


@dataclass(frozen=True)
class Served:
    url: str
    ctx: ServerContext
    http: httpx.Client

    def stats(self) -> dict[str, Any]:
        return self.ctx.engine.call(lambda engine: engine.stats()).result(timeout=30)

    def check_integrity(self) -> None:
        self.ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=30)

    def complete(self, **body: Any) -> httpx.Response:
        headers = body.pop("headers", None)
        payload = {"model": self.ctx.model_name, "prompt": [1, 2, 3, 4, 5], "max_tokens": 2, **body}
        return self.http.post("/v1/completions", json=payload, headers=headers)

    def assert_still_serving(self) -> None:
        response = self.complete(prompt="still there?", max_tokens=1)
        assert response.status_code == 200, response.text


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("sessions") / "qwen3", "qwen3")
    llm = _llm(folder)
    app = create_app(llm, ServerConfig(served_model_name="tiny"))
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        yield Served(server.url, app.state.ctx, http)
        app.state.ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=30)


def _llm(folder: Path) -> LLM:
    probe = LLM(str(folder), kv_cache_memory="1MiB")
    page_bytes = probe.stats()["kv_bytes_per_token"] * BLOCK
    return LLM(
        loaded=probe.loaded,
        kv_cache_memory=NUM_PAGES * page_bytes,
        block_size=BLOCK,
        max_model_len=512,
        retention="session",
        max_pinned_memory=PIN_CAP_PAGES * page_bytes,
    )


def assert_error(response: httpx.Response, status: int, expected: str | None = None) -> dict[str, Any]:
    """An OpenAI error object with `status`, naming `expected` as its code or param."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if expected is not None:
        assert expected in (error["code"], error["param"]), error
    return error


def release(served: Served, session_id: str) -> httpx.Response:
    return served.http.post(f"/v1/sessions/{quote(session_id, safe='')}/release")


# ---- sessions -------------------------------------------------------------------------------------


def test_session_id_travels_in_the_body_or_the_header_and_release_ends_it(served: Served) -> None:
    assert served.complete(session_id="agent-1").status_code == 200
    response = release(served, "agent-1")
    assert response.status_code == 200
    assert response.json() == {"id": "agent-1", "object": "session", "released": True}
    assert_error(release(served, "agent-1"), 404, "session_not_found")  # released already
    assert_error(release(served, "never-seen"), 404, "session_not_found")
    served.assert_still_serving()

    assert served.complete(headers={"X-Session-Id": "agent-2"}).status_code == 200
    assert release(served, "agent-2").status_code == 200

    # Both given: the body names the session, the header is ignored (but still checked).
    assert served.complete(session_id="agent-3", headers={"X-Session-Id": "agent-4"}).status_code == 200
    assert_error(release(served, "agent-4"), 404, "session_not_found")
    assert release(served, "agent-3").status_code == 200

    # Chat completions through the official client, which sends the id in the body via extra_body.
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"session_id": "team/agent 5"},
    )
    assert served.stats()["sessions_open"] >= 1
    assert release(served, "team/agent 5").status_code == 200  # a slash and a space, percent-encoded
    assert served.stats()["sessions_open"] == 0


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("body", 17),
        ("body", ""),
        ("body", ["a"]),
        ("body", "x" * 257),
        ("header", ""),
        ("header", "x" * 257),
    ],
)
def test_bad_session_ids_are_400s(served: Served, where: str, value: Any) -> None:
    if where == "body":
        response = served.complete(session_id=value)
    else:
        response = served.complete(headers={"X-Session-Id": value})
    assert_error(response, 400, "session_id")
    chat = served.http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "session_id": value, "max_tokens": 1},
    )
    assert_error(chat, 400, "session_id")
    served.assert_still_serving()


def test_a_256_character_session_id_is_fine(served: Served) -> None:
    session_id = "s" * 256
    assert served.complete(session_id=session_id).status_code == 200
    assert release(served, session_id).status_code == 200


def test_session_precedence_rule() -> None:
    assert resolve_session_id("body", "header") == "body"
    assert resolve_session_id(None, "header") == "header"
    assert resolve_session_id(None, None) is None
    with pytest.raises(APIError) as info:
        resolve_session_id("body", "")
    assert info.value.param == "session_id"


# ---- pins -----------------------------------------------------------------------------------------


def _rendered(served: Served, messages: list[dict[str, Any]], generation_prompt: bool) -> list[int]:
    tokenizer = served.ctx.tokenizer
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_pinned_head_is_the_prefix_of_later_chats_and_survives_pressure(served: Served) -> None:
    system = {"role": "system", "content": SYSTEM}
    response = served.http.post("/v1/cache/pin", json={"messages": [system], "tools": TOOLS, "ttl_s": 600})
    assert response.status_code == 200, response.text
    pin = response.json()
    assert set(pin) == {"id", "object", "num_tokens", "kv_bytes", "expires_in_s"}
    assert pin["object"] == "cache.pin" and pin["id"].startswith("pin-")
    head = _rendered(served, [system], generation_prompt=False)
    assert pin["num_tokens"] == len(head) // BLOCK * BLOCK  # whole pages: a partial last page is not held
    question = [system, {"role": "user", "content": "Fix the failing test in tests/test_io.py."}]
    assert _rendered(served, question, generation_prompt=True)[: len(head)] == head
    stats = served.stats()
    assert pin["kv_bytes"] > 0 and stats["pins"] == 1 and stats["pinned_bytes"] == pin["kv_bytes"]
    assert 0 < pin["expires_in_s"] <= 600
    assert served.http.get(f"/v1/cache/pin/{pin['id']}").json()["num_tokens"] == pin["num_tokens"]

    # Fill the pool several times over with unrelated prompts: everything unpinned is evicted.
    for i in range(2 * NUM_PAGES * BLOCK // 200):
        prompt = [(i * 211 + j * 7) % 5000 + 1000 for j in range(200)]
        assert served.complete(prompt=prompt, max_tokens=1).status_code == 200
    assert served.stats()["evictions"] > 0
    reply = served.http.post(
        "/v1/chat/completions", json={"messages": question, "tools": TOOLS, "max_tokens": 2}
    ).json()
    assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(head) // BLOCK * BLOCK

    deleted = served.http.delete(f"/v1/cache/pin/{pin['id']}")
    assert deleted.status_code == 200 and deleted.json() == {
        "id": pin["id"],
        "object": "cache.pin",
        "deleted": True,
    }
    assert_error(served.http.delete(f"/v1/cache/pin/{pin['id']}"), 404, "pin_not_found")
    assert_error(served.http.get(f"/v1/cache/pin/{pin['id']}"), 404, "pin_not_found")
    stats = served.stats()
    assert stats["pins"] == 0 and stats["pinned_bytes"] == 0 and stats["kv_pages_in_use"] == 0
    served.check_integrity()


def test_an_empty_message_list_pins_the_head_every_chat_shares(served: Served) -> None:
    response = served.http.post("/v1/cache/pin", json={"messages": [], "tools": TOOLS})
    assert response.status_code == 200, response.text
    pin = response.json()
    assert pin["expires_in_s"] is None  # no TTL: held until unpinned
    for question in ("Which tests are slow?", "Read setup.py"):
        ids = _rendered(served, [{"role": "user", "content": question}], generation_prompt=True)
        assert len(ids) > pin["num_tokens"]
    # The head reaches past the tools into the user turn's header, and no further.
    tokenizer = served.ctx.tokenizer
    a = _rendered(served, [{"role": "user", "content": "Which tests are slow?"}], generation_prompt=True)
    b = _rendered(served, [{"role": "user", "content": "Read setup.py"}], generation_prompt=True)
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert pin["num_tokens"] == shared // BLOCK * BLOCK, tokenizer.decode(
        a[:shared], skip_special_tokens=False
    )
    assert served.http.delete(f"/v1/cache/pin/{pin['id']}").status_code == 200


def test_a_pin_by_token_ids_with_a_salt(served: Served) -> None:
    ids = list(range(100, 140))
    response = served.http.post(
        "/v1/cache/pin", json={"prompt_token_ids": ids, "ttl_s": 30.5, "cache_salt": "tenant-a"}
    )
    assert response.status_code == 200, response.text
    pin = response.json()
    assert pin["num_tokens"] == len(ids) // BLOCK * BLOCK and 0 < pin["expires_in_s"] <= 30.5
    salted = served.complete(prompt=[*ids, 7], cache_salt="tenant-a").json()
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(ids) // BLOCK * BLOCK
    unsalted = served.complete(prompt=[*ids, 7]).json()
    assert unsalted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert served.http.delete(f"/v1/cache/pin/{pin['id']}").status_code == 200


def _bad_pins() -> list[tuple[str, Any, int, str | None]]:
    """(name, body (bytes are sent raw), status, code or param expected)."""
    system = [{"role": "system", "content": "x"}]
    return [
        ("not json", b'{"messages": [', 400, None),
        ("not an object", b"[1, 2]", 400, None),
        ("neither messages nor ids", {"ttl_s": 5}, 400, "messages"),
        ("both messages and ids", {"messages": system, "prompt_token_ids": [1, 2]}, 400, "messages"),
        ("messages not an array", {"messages": "hello"}, 400, "messages"),
        ("message without a role", {"messages": [{"content": "x"}]}, 400, "messages[0].role"),
        ("ids not integers", {"prompt_token_ids": ["a", "b"]}, 400, "prompt_token_ids"),
        ("ids empty", {"prompt_token_ids": []}, 400, "prompt_token_ids"),
        ("ids booleans", {"prompt_token_ids": [True, False]}, 400, "prompt_token_ids"),
        ("ids outside the vocabulary", {"prompt_token_ids": [1, 10**9]}, 400, None),
        ("tools with ids", {"prompt_token_ids": [1, 2], "tools": TOOLS}, 400, "tools"),
        ("tools not an array", {"messages": system, "tools": {"a": 1}}, 400, "tools"),
        ("negative ttl", {"prompt_token_ids": [1, 2], "ttl_s": -1}, 400, "ttl_s"),
        ("zero ttl", {"prompt_token_ids": [1, 2], "ttl_s": 0}, 400, "ttl_s"),
        ("ttl as text", {"prompt_token_ids": [1, 2], "ttl_s": "60"}, 400, "ttl_s"),
        ("ttl a boolean", {"prompt_token_ids": [1, 2], "ttl_s": True}, 400, "ttl_s"),
        ("infinite ttl", b'{"prompt_token_ids": [1, 2], "ttl_s": Infinity}', 400, "ttl_s"),
        ("nan ttl", b'{"prompt_token_ids": [1, 2], "ttl_s": NaN}', 400, "ttl_s"),
        ("overflowing ttl", b'{"prompt_token_ids": [1, 2], "ttl_s": 1e999}', 400, "ttl_s"),
        ("huge integer ttl", b'{"prompt_token_ids": [1, 2], "ttl_s": ' + b"9" * 400 + b"}", 400, "ttl_s"),
        ("empty salt", {"prompt_token_ids": [1, 2], "cache_salt": ""}, 400, "cache_salt"),
        ("prefix over the context", {"prompt_token_ids": [5] * 600}, 400, None),
        ("prefix shorter than a page", {"prompt_token_ids": [1, 2, 3]}, 400, None),
        (
            "prefix over the pin cap",
            {"prompt_token_ids": [(7 * j) % 3000 + 1 for j in range((PIN_CAP_PAGES + 2) * BLOCK)]},
            400,
            "pin_limit_exceeded",
        ),
        ("unknown model", {"model": "gpt-17", "prompt_token_ids": [1, 2]}, 404, "model_not_found"),
    ]


@pytest.mark.parametrize(("name", "body", "status", "expected"), _bad_pins(), ids=[b[0] for b in _bad_pins()])
def test_bad_pins_get_openai_errors_and_the_server_keeps_serving(
    served: Served, name: str, body: Any, status: int, expected: str | None
) -> None:
    if isinstance(body, bytes):
        response = served.http.post(
            "/v1/cache/pin", content=body, headers={"Content-Type": "application/json"}
        )
    else:
        response = served.http.post("/v1/cache/pin", json=body)
    assert_error(response, status, expected)
    served.assert_still_serving()
    stats = served.stats()
    assert stats["pins"] == 0 and stats["pinned_bytes"] == 0


def test_pins_up_to_the_cap_then_pin_limit_exceeded(served: Served) -> None:
    pins = []
    for i in range(PIN_CAP_PAGES + 1):
        ids = [(i * 389 + j * 13) % 4000 + 2000 for j in range(BLOCK)]
        response = served.http.post("/v1/cache/pin", json={"prompt_token_ids": ids, "ttl_s": 120})
        if response.status_code != 200:
            assert_error(response, 400, "pin_limit_exceeded")
            break
        pins.append(response.json()["id"])
    else:
        pytest.fail(f"{PIN_CAP_PAGES + 1} one-page pins fit under a cap of {PIN_CAP_PAGES} pages")
    assert 0 < len(pins) <= PIN_CAP_PAGES
    served.assert_still_serving()
    for pin_id in pins:
        assert served.http.delete(f"/v1/cache/pin/{pin_id}").status_code == 200
    assert served.stats()["pins"] == 0
    served.check_integrity()


def test_pin_body_parsing() -> None:
    parsed = parse_pin_request({"messages": [{"role": "developer", "content": "x"}], "ttl_s": 3})
    assert parsed.messages == [{"role": "system", "content": "x"}] and parsed.ttl_s == 3.0
    assert parse_pin_request({"prompt_token_ids": [4, 5]}).ttl_s is None
    assert parse_pin_request({"prompt_token_ids": [4, 5], "ttl_s": 0.25}).ttl_s == 0.25
    for ttl in (0, -0.5, math.inf, -math.inf, math.nan):
        with pytest.raises(APIError) as info:
            parse_pin_request({"prompt_token_ids": [4, 5], "ttl_s": ttl})
        assert (info.value.status, info.value.param) == (400, "ttl_s")


# ---- metrics --------------------------------------------------------------------------------------


def test_metrics_expose_tiers_pins_and_sessions_by_route_template(served: Served) -> None:
    pin = served.http.post("/v1/cache/pin", json={"prompt_token_ids": list(range(11, 11 + 2 * BLOCK))}).json()
    served.http.get(f"/v1/cache/pin/{pin['id']}")
    served.http.delete(f"/v1/cache/pin/{pin['id']}")
    release(served, "nobody")
    text = served.http.get("/metrics").text
    gauges = ("offloaded_bytes", "pinned_bytes", "pins", "sessions_open", "sessions_paused")
    counters = (
        "offload_loads",
        "offload_load_bytes",
        "offload_drops",
        "offload_stores",
        "swap_preemptions",
        "recompute_preemptions",
    )
    for name in gauges:
        assert f"\n# TYPE swarmkv_{name} gauge\n" in text, name
    for name in counters:
        assert f"\n# TYPE swarmkv_{name}_total counter\n" in text and f"\nswarmkv_{name}_total " in text, name
    for route in ("/v1/cache/pin", "/v1/cache/pin/{pin_id}", "/v1/sessions/{session_id:path}/release"):
        assert f'route="{route}"' in text, route
    assert pin["id"] not in text and "nobody" not in text


# ---- the loop thread's pending pins ---------------------------------------------------------------


class _FakePinEngine:
    """The four pin verbs of LLMEngine, over a dict."""

    def __init__(self) -> None:
        self.pins: dict[str, PinInfo] = {}

    def add_pin(
        self, pin_id: str, ids: list[int], ttl_s: float | None, cache_salt: str | None = None
    ) -> None:
        if len(ids) > 32:
            raise PinLimitError("over the cap")
        self.pins[pin_id] = PinInfo(pin_id, len(ids), 1024, ttl_s, ready=False)

    def get_pin(self, pin_id: str) -> PinInfo | None:
        return self.pins.get(pin_id)

    def unpin(self, pin_id: str) -> bool:
        return self.pins.pop(pin_id, None) is not None


def _add(pending: PendingPins, engine: Any, pin_id: str, num_tokens: int) -> concurrent.futures.Future[Any]:
    ready: concurrent.futures.Future[Any] = concurrent.futures.Future()
    pending.add(engine, AddPin(pin_id, [1] * num_tokens, None, None, ready))
    return ready


def test_pending_pins_settle_refuse_unpin_and_fail() -> None:
    engine, pending = _FakePinEngine(), PendingPins()
    refused = _add(pending, engine, "big", 64)
    assert isinstance(refused.exception(timeout=0), PinLimitError) and "big" not in pending

    done = _add(pending, engine, "a", 16)
    pending.settle(engine, RequestDelta("a", [5], "x", finished=False, finish_reason=None))
    assert not done.done()
    pending.settle(engine, RequestDelta("a", [5], "x", finished=True, finish_reason="length"))
    assert done.result(timeout=0) == engine.pins["a"] and "a" not in pending

    failed = _add(pending, engine, "b", 16)
    pending.settle(engine, RequestDelta("b", [], "", finished=True, finish_reason=None, error="boom"))
    assert isinstance(failed.exception(timeout=0), EngineStepError)

    deleted = _add(pending, engine, "c", 16)
    assert pending.unpin(engine, "c") and deleted.result(timeout=0) is None  # its creator gets a 404
    assert not pending.unpin(engine, "c")

    stopped = _add(pending, engine, "d", 16)
    pending.fail_all(engine, EngineUnavailableError("shutting down"))
    assert isinstance(stopped.exception(timeout=0), EngineUnavailableError)
    assert "d" not in pending and "d" not in engine.pins
