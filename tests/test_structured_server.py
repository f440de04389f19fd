"""Structured outputs through the server on the embedded default (int4: parse and validation only, never
exact tokens): chat completions' response_format, streamed and not, forced and strict tool calls, Responses'
text.format, Messages' output_config.format and a forced tool; an unsupported strict keyword is a 400."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest

from swarmkv.engine.llm import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.structured.decoding import GrammarCache
from swarmkv.structured.grammars import json_object_grammar

pytestmark = [pytest.mark.model, pytest.mark.e2e]

API_KEY = "test-key"
TIMEOUT_S = 600.0
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY_SCHEMA, "strict": True}},
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 60}}},
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory="96MiB", max_model_len=2048, max_num_seqs=8)


@pytest.fixture(scope="module")
def url(llm: LLM) -> Iterator[str]:
    app = create_app(llm, ServerConfig(api_key=API_KEY))
    with BackgroundServer(app) as server:
        yield server.url
        app.state.ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=TIMEOUT_S)


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}", "x-api-key": API_KEY}
    return httpx.post(url + path, json=body, headers=headers, timeout=TIMEOUT_S)


def _fmt(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "w", "schema": schema, "strict": True}}


def _assert_json_object_or_its_prefix(llm: LLM, text: str, finish_reason: str) -> None:
    """A finished reply is a JSON object; one cut by max_tokens (the int4 model may write a long string,
    its length depending on the CPU's rounding) is text a JSON object grammar accepts so far."""
    if finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
        return
    assert finish_reason == "length"
    grammars = GrammarCache(llm.tokenizer, llm.loaded.config.vocab_size)
    matcher = grammars.matcher(json_object_grammar())
    matcher.consume_tokens(grammars.tokenizer.tokenize_str(text))
    assert text.startswith("{") and not matcher.is_error(), (text, matcher.get_error())


def test_chat_json_schema_whole_and_streamed(llm: LLM, url: str) -> None:
    body = {"messages": ASK, "response_format": _fmt(CITY_SCHEMA), "max_tokens": 128, "temperature": 0}
    reply = _post(url, "/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), CITY_SCHEMA)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    streamed = {**body, "stream": True, "temperature": 0.8, "seed": 3}
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json=streamed, headers=headers, timeout=TIMEOUT_S
    ) as r:
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    text = "".join(json.loads(line)["choices"][0]["delta"].get("content") or "" for line in lines)
    jsonschema.validate(json.loads(text), CITY_SCHEMA)
    obj = _post(url, "/v1/chat/completions", {**body, "response_format": {"type": "json_object"}})
    choice = obj.json()["choices"][0]
    _assert_json_object_or_its_prefix(llm, choice["message"]["content"], choice["finish_reason"])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_forced_call_follows_its_schema(url: str, stream: bool) -> None:
    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 128, "stream": stream}
    if not stream:
        reply = _post(url, "/v1/chat/completions", body).json()["choices"][0]
        assert reply["finish_reason"] == "tool_calls"
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in reply["message"]["tool_calls"]]
    else:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=TIMEOUT_S
        ) as r:
            lines = [
                line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"
            ]
        pieces: dict[int, list[str]] = {}
        names: dict[int, str] = {}
        for line in lines:
            for call in json.loads(line)["choices"][0]["delta"].get("tool_calls") or []:
                names.setdefault(call["index"], call.get("function", {}).get("name"))
                pieces.setdefault(call["index"], []).append(call.get("function", {}).get("arguments") or "")
        calls = [(names[i], "".join(pieces[i])) for i in sorted(pieces)]
    assert calls
    for name, arguments in calls:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
        jsonschema.validate(json.loads(arguments), schema)


def test_responses_text_format_and_messages_output_config(url: str) -> None:
    fmt = {"type": "json_schema", "name": "w", "schema": CITY_SCHEMA, "strict": True}
    body = {"input": ASK[0]["content"], "text": {"format": fmt}, "max_output_tokens": 128}
    reply = _post(url, "/v1/responses", body)
    assert reply.status_code == 200, reply.text
    message = next(item for item in reply.json()["output"] if item["type"] == "message")
    jsonschema.validate(json.loads(message["content"][0]["text"]), CITY_SCHEMA)
    messages_body = {
        "messages": ASK,
        "max_tokens": 128,
        "output_config": {"format": {"type": "json_schema", "schema": CITY_SCHEMA}},
    }
    reply = _post(url, "/v1/messages", messages_body)
    assert reply.status_code == 200, reply.text
    jsonschema.validate(json.loads(reply.json()["content"][0]["text"]), CITY_SCHEMA)
    tool = {"name": "get_weather", "input_schema": CITY_SCHEMA, "strict": True}
    forced = {**messages_body, "tools": [tool], "tool_choice": {"type": "tool", "name": "get_weather"}}
    del forced["output_config"]
    reply = _post(url, "/v1/messages", forced)
    blocks = [b for b in reply.json()["content"] if b["type"] == "tool_use"]
    assert blocks and blocks[0]["name"] == "get_weather"
    jsonschema.validate(blocks[0]["input"], CITY_SCHEMA)


def test_an_unsupported_strict_keyword_is_a_400_naming_it(url: str) -> None:
    schema = {"type": "object", "dependentSchemas": {"a": {}}}
    reply = _post(url, "/v1/chat/completions", {"messages": ASK, "response_format": _fmt(schema)})
    assert reply.status_code == 400
    assert "dependentSchemas" in reply.json()["error"]["message"]
