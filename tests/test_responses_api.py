"""The OpenAI Responses API on `swarmkv serve`, end to end with the official `openai` client.

One server (real default model, API key required) serves the module; the tests check responses from a
string and from items, a forced function call and its output continued by `previous_response_id`, a chain
that prefills only its new items, `store: false`, the event stream, input_tokens, GET and DELETE, and errors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from swarmkv.engine.llm import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext

API_KEY = "test-key"
# Generous: a reply takes minutes on a slow CPU, or under ATEN_CPU_CAPABILITY=default's scalar kernels.
TIMEOUT_S = 600.0
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PAGE_TOKENS = 16
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
INSTRUCTIONS = "You are a careful assistant for a team of software engineers. Answer briefly and precisely."

pytestmark = [pytest.mark.model, pytest.mark.e2e]


@dataclass(frozen=True)
class Served:
    url: str
    ctx: ServerContext
    model: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S)

    def create(self, **kwargs: Any) -> Any:
        return self.client().responses.create(model=self.model, temperature=0, **kwargs)

    def prefill_tokens_computed(self) -> int:
        stats = self.ctx.engine.call(lambda engine: engine.stats()).result(timeout=TIMEOUT_S)
        return int(stats["prefill_tokens_computed"])


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    llm = LLM(kv_cache_memory="96MiB", max_model_len=1024, max_num_seqs=8)
    app = create_app(llm, ServerConfig(api_key=API_KEY))
    with BackgroundServer(app) as server:
        ctx: ServerContext = app.state.ctx
        yield Served(server.url, ctx, ctx.model_name)
        ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=TIMEOUT_S)


def test_response_from_a_string_and_from_items(served: Served) -> None:
    reply = served.create(input="Name three colors.", instructions=INSTRUCTIONS, max_output_tokens=8)
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == served.model
    assert reply.status in ("completed", "incomplete")
    (message,) = reply.output
    assert (
        message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    )
    assert reply.output_text == message.content[0].text and reply.output_text
    assert 0 < reply.usage.output_tokens <= 8 and reply.usage.output_tokens_details.reasoning_tokens == 0
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    if reply.status == "incomplete":
        assert reply.incomplete_details is not None and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.instructions == INSTRUCTIONS and reply.store is True and reply.text.format.type == "text"

    items = [
        {"role": "developer", "content": INSTRUCTIONS},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Name three colors."}],
        },
    ]
    # The same prompt: it finds the first reply's pages. The int4 model's rounding depends on a step's shapes
    # and on the CPU, so the texts are compared between two requests that found the same pages.
    from_items = served.create(input=items, max_output_tokens=8)
    again = served.create(input="Name three colors.", instructions=INSTRUCTIONS, max_output_tokens=8)
    assert from_items.usage.input_tokens == reply.usage.input_tokens
    cached = from_items.usage.input_tokens_details.cached_tokens
    assert cached > 0 and again.usage.input_tokens_details.cached_tokens == cached
    assert from_items.output_text == again.output_text


def test_forced_function_call_then_its_output_continues_the_chain(served: Served) -> None:
    # SmolLM2-135M seldom calls a tool by itself; a named tool_choice forces the call.
    choice = {"type": "function", "name": "get_weather"}
    call_reply = served.create(
        input="What is the weather in Paris?", tools=[WEATHER], tool_choice=choice, max_output_tokens=48
    )
    (call,) = call_reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and isinstance(json.loads(call.arguments), dict)
    assert call_reply.status == "completed"

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"}
    answer = served.create(
        input=[result], previous_response_id=call_reply.id, tools=[WEATHER], max_output_tokens=8
    )
    assert answer.previous_response_id == call_reply.id
    assert answer.usage.input_tokens > call_reply.usage.input_tokens  # the call and its output were rendered
    assert answer.usage.input_tokens_details.cached_tokens >= call_reply.usage.input_tokens - PAGE_TOKENS


def test_a_chain_prefills_only_its_new_items(served: Served) -> None:
    turns = ["Tell me about gardens.", "And about rivers?", "And about mountains?"]
    replies: list[Any] = []
    prefills: list[int] = []
    for text in turns:
        before = served.prefill_tokens_computed()
        previous = {"previous_response_id": replies[-1].id} if replies else {}
        replies.append(served.create(input=text, max_output_tokens=6, **previous))
        prefills.append(served.prefill_tokens_computed() - before)
    for earlier, later, prefill in zip(replies[:-1], replies[1:], prefills[1:], strict=True):
        assert later.usage.input_tokens_details.cached_tokens >= earlier.usage.input_tokens - PAGE_TOKENS
        # The new items: the earlier reply as rendered history plus the new user turn.
        new_tokens = later.usage.input_tokens - earlier.usage.input_tokens
        assert prefill <= new_tokens + PAGE_TOKENS, (prefill, new_tokens)
    assert prefills[2] < replies[2].usage.input_tokens - PAGE_TOKENS


def test_store_false_cannot_be_continued(served: Served) -> None:
    reply = served.create(input="Say hello.", store=False, max_output_tokens=4)
    assert reply.store is False
    with pytest.raises(openai.NotFoundError) as caught:
        served.create(input="Again.", previous_response_id=reply.id, max_output_tokens=4)
    assert caught.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        served.client().responses.retrieve(reply.id)


def test_stream_events_arrive_in_order(served: Served) -> None:
    kwargs: dict[str, Any] = {"input": "Name three colors.", "max_output_tokens": 8, "temperature": 0}
    served.create(input=kwargs["input"], max_output_tokens=8)  # warms the cache for the three compared below
    whole = served.create(input=kwargs["input"], max_output_tokens=8)
    with served.client().responses.stream(model=served.model, **kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.usage is not None
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}

    events = list(served.client().responses.create(model=served.model, stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == whole.output_text

    choice = {"type": "function", "name": "get_weather"}
    call_kwargs: dict[str, Any] = {"tools": [WEATHER], "tool_choice": choice, "max_output_tokens": 48}
    with served.client().responses.stream(
        model=served.model, input="Weather in Oslo?", temperature=0, **call_kwargs
    ) as stream:
        call_kinds = [event.type for event in stream]
        (call,) = stream.get_final_response().output
    assert "response.function_call_arguments.delta" in call_kinds
    assert call_kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert call.type == "function_call" and isinstance(json.loads(call.arguments), dict)


def test_input_tokens_counts_without_generating(served: Served) -> None:
    body = {"model": served.model, "input": "Name three colors.", "instructions": INSTRUCTIONS}
    counted = httpx.post(
        f"{served.url}/v1/responses/input_tokens", json=body, headers=AUTH, timeout=TIMEOUT_S
    )
    assert counted.status_code == 200
    assert counted.json()["object"] == "response.input_tokens"
    reply = served.create(input=body["input"], instructions=INSTRUCTIONS, max_output_tokens=2)
    assert counted.json()["input_tokens"] == reply.usage.input_tokens


def test_get_and_delete(served: Served) -> None:
    client = served.client()
    first = served.create(input="Say hello.", max_output_tokens=4)
    second = served.create(input="Again.", previous_response_id=first.id, max_output_tokens=4)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    session_id = first.id  # a chain's session is named by its first response
    client.responses.delete(second.id)  # the chain's newest: its session is released
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    released = served.ctx.engine.call(lambda engine: engine.release_session(session_id)).result(
        timeout=TIMEOUT_S
    )
    assert released is False  # already released by the delete
    assert client.responses.retrieve(first.id).id == first.id
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(second.id)


@pytest.mark.parametrize(
    ("body", "status", "names"),
    [
        # Hosted tools (web_search, ...) are dropped by default (tests/test_harness_responses.py).
        (
            {"input": "hi", "tools": [{"type": "namespace", "name": "n", "tools": [{"type": "web_search"}]}]},
            400,
            "tools[0].tools[0] must be a function tool",
        ),
        (
            {
                "input": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}
                ]
            },
            400,
            "input_image",
        ),
        ({"input": "hi", "max_output_tokens": -1}, 400, "max_output_tokens"),
        ({"input": "hi", "background": True}, 400, "background"),
        ({"input": "hi", "tools": {"type": "function"}}, 400, "'tools' must be an array"),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, 404, "resp_unknown"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(
    served: Served, body: dict[str, Any], status: int, names: str
) -> None:
    answer = httpx.post(
        f"{served.url}/v1/responses", json={"model": served.model, **body}, headers=AUTH, timeout=TIMEOUT_S
    )
    assert answer.status_code == status
    error = answer.json()["error"]
    assert names in error["message"] and error["type"] == "invalid_request_error"
    assert served.create(input="Say hi.", max_output_tokens=2).status in ("completed", "incomplete")
