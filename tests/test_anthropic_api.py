"""The Anthropic Messages API on `swarmkv serve`, end to end with the official `anthropic` client.

One server (real default model, API key required) serves the module; the tests check the message and
its stream, a tool-use round trip, token counting, cache_control pins, and Anthropic-shaped errors.
The default model's int4 rounding depends on a step's shapes and on the CPU, so two replies are compared
only after the same prompt warmed the prefix cache: the identical requests that follow find the same
pages and compute the same tokens with the same shapes, on any machine.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import pytest

from swarmkv.engine.llm import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext

API_KEY = "test-key"
# Generous: a reply takes minutes on a slow CPU, or under ATEN_CPU_CAPABILITY=default's scalar kernels.
TIMEOUT_S = 600.0
# anthropic>=2 dropped `temperature` from create(); the API still takes it, so it travels in extra_body.
GREEDY = {"temperature": 0}
MAX_REQUEST_BYTES = 1 << 20
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
# Several 16-token pages long, so that a pin of it holds whole pages.
SYSTEM = (
    "You are a careful assistant for a team of software engineers. Answer briefly and precisely. "
    "Prefer concrete examples over general advice. When you are unsure, say so and explain what you "
    "would check. Never invent file names, functions or command line flags."
)


pytestmark = [pytest.mark.model, pytest.mark.e2e]


@dataclass(frozen=True)
class Served:
    url: str
    ctx: ServerContext
    model: str

    def client(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S)

    def create(self, **kwargs: Any) -> Any:
        return self.client().messages.create(model=self.model, **kwargs)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    llm = LLM(kv_cache_memory="96MiB", max_model_len=1024, max_num_seqs=8, max_pinned_memory="32MiB")
    app = create_app(llm, ServerConfig(api_key=API_KEY, max_request_bytes=MAX_REQUEST_BYTES))
    with BackgroundServer(app) as server:
        ctx: ServerContext = app.state.ctx
        yield Served(server.url, ctx, ctx.model_name)
        ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=TIMEOUT_S)


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def test_message_whole_and_streamed_agree(served: Served) -> None:
    kwargs: dict[str, Any] = {"system": SYSTEM, "messages": _user("Name three colors."), "max_tokens": 12}
    served.create(extra_body=GREEDY, **kwargs)  # warms the cache for the two compared below
    whole = served.create(extra_body=GREEDY, **kwargs)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert 0 < whole.usage.output_tokens <= 12
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 0

    with served.client().messages.stream(model=served.model, extra_body=GREEDY, **kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == whole.content[0].text
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.output_tokens == whole.usage.output_tokens

    async def run() -> list[str]:
        client = anthropic.AsyncAnthropic(
            base_url=served.url, api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S
        )
        events = await client.messages.create(model=served.model, extra_body=GREEDY, stream=True, **kwargs)
        return [event.type async for event in events]

    kinds = asyncio.run(run())  # the client drops pings
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}

    raw = httpx.post(
        f"{served.url}/v1/messages",
        json={"model": served.model, "stream": True, **kwargs},
        headers={"x-api-key": API_KEY},
        timeout=TIMEOUT_S,
    )
    names = [line.removeprefix("event: ") for line in raw.text.splitlines() if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"


def test_tool_use_round_trip(served: Served) -> None:
    # SmolLM2-135M seldom calls a tool by itself; a named tool_choice forces the call.
    ask = _user("What is the weather in Paris?")
    kwargs: dict[str, Any] = {"tools": [WEATHER], "max_tokens": 48, "extra_body": GREEDY}
    forced = {"type": "tool", "name": "get_weather"}
    served.create(messages=ask, tool_choice=forced, **kwargs)  # warms the cache
    reply = served.create(messages=ask, tool_choice=forced, **kwargs)
    assert reply.stop_reason == "tool_use"
    (call,) = reply.content
    assert call.type == "tool_use" and call.name == "get_weather" and isinstance(call.input, dict)

    with served.client().messages.stream(model=served.model, messages=ask, tool_choice=forced, **kwargs) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", call.name, call.input)]

    history = [
        *ask,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 21 C"}],
        },
    ]
    answer = served.create(messages=history, tool_choice={"type": "none"}, **kwargs)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]
    # The rendered history holds the call and its result, so it is longer than the question alone.
    longer = served.client().messages.count_tokens(model=served.model, messages=history, tools=[WEATHER])
    shorter = served.client().messages.count_tokens(model=served.model, messages=ask, tools=[WEATHER])
    assert longer.input_tokens > shorter.input_tokens


def test_count_tokens_is_the_rendered_prompt(served: Served) -> None:
    messages = _user("How many tokens is this?")
    counted = served.client().messages.count_tokens(model=served.model, system=SYSTEM, messages=messages)
    rendered = served.ctx.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, *messages])
    assert counted.input_tokens == len(served.ctx.tokenizer.encode(rendered, add_special_tokens=False))
    reply = served.create(system=SYSTEM, messages=messages, max_tokens=1)
    total = (
        reply.usage.input_tokens
        + reply.usage.cache_read_input_tokens
        + reply.usage.cache_creation_input_tokens
    )
    assert total == counted.input_tokens


def test_cache_control_pins_then_reads(served: Served) -> None:
    system = [{"type": "text", "text": f"Cache test. {SYSTEM}", "cache_control": {"type": "ephemeral"}}]
    first = served.create(system=system, messages=_user("Hello."), max_tokens=2)
    assert first.usage.cache_creation_input_tokens > 0
    second = served.create(system=system, messages=_user("Goodbye."), max_tokens=2)
    assert second.usage.cache_read_input_tokens > 0
    assert second.usage.cache_creation_input_tokens == 0  # the same pin, refreshed
    tool = {**WEATHER, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    served.create(tools=[tool], messages=_user("Hi."), max_tokens=1)


def test_a_stop_sequence_is_reported(served: Served) -> None:
    kwargs: dict[str, Any] = {"messages": _user("Name three colors."), "max_tokens": 16, "extra_body": GREEDY}
    served.create(**kwargs)  # warms the cache: the three below then write the same tokens up to the stop
    text = served.create(**kwargs).content[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]  # the reply stops where the third word first appears
    cut = text[: text.index(stop)]
    reply = served.create(stop_sequences=["never-written-9f2", stop], **kwargs)
    assert (reply.stop_reason, reply.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in reply.content) == cut
    with served.client().messages.stream(model=served.model, stop_sequences=[stop], **kwargs) as stream:
        streamed = stream.get_final_message()
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)
    assert "".join(b.text for b in streamed.content) == cut


def test_tool_input_streams_in_pieces(served: Served) -> None:
    body = {
        "model": served.model,
        "messages": _user("What is the weather in Paris?"),
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "max_tokens": 48,
        "temperature": 0,
    }
    for _ in range(2):  # the first warms the cache for the second and the stream
        whole = httpx.post(
            f"{served.url}/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=TIMEOUT_S
        )
    (call,) = whole.json()["content"]
    raw = httpx.post(
        f"{served.url}/v1/messages",
        json={**body, "stream": True},
        headers={"x-api-key": API_KEY},
        timeout=TIMEOUT_S,
    )
    events = [json.loads(line[6:]) for line in raw.text.splitlines() if line.startswith("data: ")]
    pieces = [
        e["delta"]["partial_json"]
        for e in events
        if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"
    ]
    assert len(pieces) > 1, pieces  # token by token, not the whole object at the end
    assert json.loads("".join(pieces)) == call["input"]
    starts = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [(b["type"], b["name"], b["input"]) for b in starts] == [("tool_use", "get_weather", {})]


def test_a_cache_control_pin_is_released_when_its_ttl_passes(served: Served) -> None:
    offset = [0.0]
    engine = served.ctx.engine

    def with_clock(clock: Any) -> None:
        engine.call(lambda e: setattr(e.core.pins, "_clock", clock)).result(timeout=TIMEOUT_S)

    # A clock that moves only when the test moves it: a slow reply must not age the pin.
    start_s = time.monotonic()
    with_clock(lambda: start_s + offset[0])
    try:
        system = [{"type": "text", "text": f"TTL test. {SYSTEM}", "cache_control": {"type": "ephemeral"}}]
        offset[0] = 3601.0  # past every earlier test's pins, an hour's included
        before = engine.call(lambda e: (e.core.pins.expire(), e.core.kv.num_pinned)[1]).result(
            timeout=TIMEOUT_S
        )
        first = served.create(system=system, messages=_user("Hello."), max_tokens=1)
        assert first.usage.cache_creation_input_tokens > 0
        held = engine.call(lambda e: e.core.kv.num_pinned).result(timeout=TIMEOUT_S)
        assert held > before
        offset[0] += 299.0  # inside the default 5 minutes: the pin holds
        assert (
            engine.call(lambda e: (e.core.pins.expire(), e.core.kv.num_pinned)[1]).result(timeout=TIMEOUT_S)
            == held
        )
        offset[0] += 2.0
        assert (
            engine.call(lambda e: (e.core.pins.expire(), e.core.kv.num_pinned)[1]).result(timeout=TIMEOUT_S)
            < held
        )
        again = served.create(system=system, messages=_user("Hello."), max_tokens=1)
        # Pinned anew; its pages were still cached, so the new pin read them and created nothing.
        assert again.usage.cache_read_input_tokens > 0
        assert engine.call(lambda e: e.core.kv.num_pinned).result(timeout=TIMEOUT_S) > 0
    finally:
        with_clock(time.monotonic)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (
            [{"type": "text", "text": str(i), "cache_control": {"type": "ephemeral"}} for i in range(5)],
            "at most 4",
        ),
        (
            [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}],
            "image blocks are not supported: swarmkv runs the text model only",
        ),
        ([{"type": "thinking_machine", "text": "x"}], "'thinking_machine' is not supported"),
    ],
)
def test_bad_blocks_are_anthropic_400s(served: Served, content: list[dict[str, Any]], needle: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as caught:
        served.create(messages=[{"role": "user", "content": content}], max_tokens=4)
    assert caught.value.status_code == 400
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and needle in body["error"]["message"]


def test_errors_take_anthropic_shape_and_the_server_keeps_serving(served: Served) -> None:
    with pytest.raises(anthropic.BadRequestError):
        served.create(messages=_user("hi"), max_tokens=-1)
    with pytest.raises(anthropic.BadRequestError):
        served.create(messages=_user("hi"), max_tokens=4, tools=[{"name": "x"}])
    # Any name is answered by default, and the reply carries it.
    assert served.client().messages.create(model="nope", messages=_user("hi"), max_tokens=1).model == "nope"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0).messages.create(
            model=served.model, messages=_user("hi"), max_tokens=4
        )
    missing = httpx.post(
        f"{served.url}/v1/messages", json={"messages": _user("hi")}, headers={"x-api-key": API_KEY}
    )
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
    not_a_list = httpx.post(
        f"{served.url}/v1/messages",
        json={"model": served.model, "max_tokens": 4, "messages": _user("hi"), "tools": {"name": "x"}},
        headers={"x-api-key": API_KEY},
    )
    assert (
        not_a_list.status_code == 400 and "'tools' must be an array" in not_a_list.json()["error"]["message"]
    )
    # Claude Code's metadata.user_id is longer than a session id may be; it still names a session.
    still = served.create(messages=_user("still there?"), max_tokens=1, metadata={"user_id": "u" * 300})
    assert still.usage.output_tokens == 1


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages"])
def test_deep_and_large_bodies_are_400s(served: Served, route: str) -> None:
    headers = {"x-api-key": API_KEY, "content-type": "application/json"}
    deep = '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"
    large = json.dumps({"messages": _user("x" * (MAX_REQUEST_BYTES + 1)), "max_tokens": 1})
    for body in (deep, large):
        response = httpx.post(f"{served.url}{route}", content=body, headers=headers, timeout=TIMEOUT_S)
        assert response.status_code == 400, response.text
    assert "limit" in response.text
