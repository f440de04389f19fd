"""What Codex CLI and Qwen Code send by default, through `swarmkv serve` on the scripted checkpoint.

Codex CLI's first request (trimmed from the one Codex 0.171 sent: developer items, a `namespace` tool, a
hosted `web_search`, `store: false`, `include`, `client_metadata`, `prompt_cache_key`, no
`max_output_tokens`) gets a 200, its namespaced function's call comes back with `function_call.namespace`,
and its hosted tool is left out and named. Qwen Code's `max_tokens: 32000` on a short context is clamped
to what the context leaves (finish "length"). `--hosted-tools refuse` and `--max-tokens-policy refuse`
turn both into 400s; a prompt alone over the context is a 400 under either policy. `prompt_cache_key`
names the session when nothing else does.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from scripted_model import CITY
from swarmkv.engine.llm import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext

pytestmark = pytest.mark.e2e  # each test runs a real server

TIMEOUT_S = 600.0
MAX_MODEL_LEN = 2048
NAMESPACE = "multi_agent_v1"
CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
EXEC_COMMAND = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
SESSION_KEY = "01a232ea-4919-7b20-a59f-a879e1ec330c"


def codex_first_request(**changes: Any) -> dict[str, Any]:
    """Codex 0.171's first /v1/responses body, its structure kept and its texts shortened."""
    body: dict[str, Any] = {
        "model": "scripted",
        "stream": False,
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [
                    {"type": "input_text", "text": "You are a coding agent running in the Codex CLI."}
                ],
            },
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "<permissions>danger-full-access</permissions>"}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "<environment_context><cwd>/w</cwd></environment_context>"}
                ],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        ],
        "tools": [
            EXEC_COMMAND,
            {
                "type": "namespace",
                "name": NAMESPACE,
                "description": "Tools for spawning and managing sub-agents.",
                "tools": [
                    {
                        "type": "function",
                        "name": "get_weather",
                        "description": "Get the weather in a city.",
                        "strict": False,
                        "parameters": CITY_SCHEMA,
                    }
                ],
            },
            {"type": "web_search", "external_web_access": True},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": SESSION_KEY,
        "client_metadata": {"x-codex-turn-metadata": json.dumps({"session_id": SESSION_KEY})},
    }
    body.update(changes)
    return body


@dataclass(frozen=True)
class Served:
    http: httpx.Client
    ctx: ServerContext

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return self.http.post(path, json=body)

    def release(self, session_id: str) -> int:
        return self.http.post(f"/v1/sessions/{quote(session_id, safe='')}/release").status_code


def _serve(model_dir: Path, config: ServerConfig) -> Iterator[Served]:
    llm = LLM(
        str(model_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=MAX_MODEL_LEN, max_num_seqs=4
    )
    app = create_app(llm, config)
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=TIMEOUT_S) as http:
        ctx: ServerContext = app.state.ctx
        yield Served(http, ctx)
        ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def served(scripted_model_dir: Path) -> Iterator[Served]:
    """The defaults: hosted tools dropped, max_tokens clamped."""
    yield from _serve(scripted_model_dir, ServerConfig(served_model_name="scripted"))


@pytest.fixture(scope="module")
def strict(scripted_model_dir: Path) -> Iterator[Served]:
    """`--hosted-tools refuse --max-tokens-policy refuse`."""
    config = ServerConfig(served_model_name="scripted", hosted_tools="refuse", max_tokens_policy="refuse")
    yield from _serve(scripted_model_dir, config)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    return error


def test_codex_first_request_gets_a_namespaced_call_and_names_the_dropped_tool(served: Served) -> None:
    response = served.post("/v1/responses", codex_first_request())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["status"] == "completed" and body["store"] is False
    (call,) = body["output"]
    assert (call["type"], call["name"], call["namespace"]) == ("function_call", "get_weather", NAMESPACE)
    assert json.loads(call["arguments"]) == {"city": CITY}
    assert body["swarmkv"] == {"dropped_tools": ["tools[2]: web_search"]}
    assert body["metadata"] == {}  # the client's own, untouched
    # prompt_cache_key named the session: releasing it finds it.
    assert served.release(SESSION_KEY) == 200


def test_a_namespaced_call_streams_with_its_namespace_and_continues(served: Served) -> None:
    with served.http.stream("POST", "/v1/responses", json=codex_first_request(stream=True)) as response:
        assert response.status_code == 200
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [item.get("namespace") for item in added + done] == [NAMESPACE, NAMESPACE]
    (completed,) = [e["response"] for e in events if e["type"] == "response.completed"]
    assert completed["swarmkv"]["dropped_tools"] == ["tools[2]: web_search"]
    # Codex's next turn sends the call back with its namespace, then the tool's output.
    call = done[0]
    turn = {key: call[key] for key in ("type", "call_id", "name", "namespace", "arguments")}
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny"}
    body = codex_first_request()
    body["input"] = body["input"] + [turn, output]
    answer = served.post("/v1/responses", body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["output"][0]["type"] == "message"


def test_hosted_tools_are_refused_under_refuse(strict: Served) -> None:
    error = _error(strict.post("/v1/responses", codex_first_request()), 400)
    assert error["param"] == "tools[2]" and "web_search" in error["message"]
    # Namespaces are accepted under either policy.
    tools = codex_first_request()["tools"][:2]
    assert strict.post("/v1/responses", codex_first_request(tools=tools)).status_code == 200


def test_two_functions_under_one_name_are_a_400(served: Served) -> None:
    tools = codex_first_request()["tools"]
    clash = {**EXEC_COMMAND, "name": "get_weather"}
    error = _error(served.post("/v1/responses", codex_first_request(tools=[clash, *tools])), 400)
    assert "get_weather" in error["message"] and error["param"] == "tools[2].tools[0]"


def _padded_chat(served: Served, room: int, **fields: Any) -> dict[str, Any]:
    """A chat body whose prompt leaves `room` tokens of the context (the scripted tokenizer is byte-level)."""
    probe = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    num_prompt_tokens = served.post("/v1/chat/completions", probe).json()["usage"]["prompt_tokens"]
    pad = "x" * (MAX_MODEL_LEN - num_prompt_tokens - room + 1)
    return {"messages": [{"role": "user", "content": pad}], **fields}


def test_qwen_code_max_tokens_is_clamped_to_the_room_left(served: Served) -> None:
    # Qwen Code's default: max_tokens 32000, streamed with usage. The scripted reply is longer than 3 tokens.
    body = _padded_chat(served, 3, max_tokens=32000, stream=True, stream_options={"include_usage": True})
    with served.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        chunks = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(c) for c in chunks if c != "[DONE]"]
    assert [c["choices"][0]["finish_reason"] for c in events if c["choices"]][-1] == "length"
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 3 and usage["prompt_tokens"] + 3 == MAX_MODEL_LEN


@pytest.mark.parametrize(
    ("route", "field"),
    [
        ("/v1/chat/completions", "max_completion_tokens"),
        ("/v1/completions", "max_tokens"),
        ("/v1/responses", "max_output_tokens"),
    ],
)
def test_every_api_clamps_and_refuse_refuses(served: Served, strict: Served, route: str, field: str) -> None:
    chat = _padded_chat(served, 3)
    if route == "/v1/completions":
        # A raw prompt's scripted reply is the end of turn at once; ignore_eos writes on to the limit.
        body: dict[str, Any] = {"prompt": chat["messages"][0]["content"] + "xxxxxxxx", "ignore_eos": True}
    elif route == "/v1/responses":
        body = {"input": chat["messages"][0]["content"], "store": False}
    else:
        body = chat
    body[field] = 32000
    reply = served.post(route, body)
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    if route == "/v1/responses":
        assert reply.json()["status"] == "incomplete"
        assert usage["input_tokens"] + usage["output_tokens"] == MAX_MODEL_LEN
    else:
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
    error = _error(strict.post(route, body), 400)
    assert error["code"] == "context_length_exceeded" and "32000 for the completion" in error["message"]


@pytest.mark.parametrize("fixture", ["served", "strict"])
def test_a_prompt_alone_over_the_context_is_a_400(request: pytest.FixtureRequest, fixture: str) -> None:
    server: Served = request.getfixturevalue(fixture)
    body = {"messages": [{"role": "user", "content": "x" * MAX_MODEL_LEN}], "max_tokens": 32000}
    error = _error(server.post("/v1/chat/completions", body), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"


def test_prompt_cache_key_names_the_session_after_session_id_and_the_header(served: Served) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert served.post("/v1/chat/completions", {**chat, "prompt_cache_key": "pck-1"}).status_code == 200
    assert served.release("pck-1") == 200
    # An explicit session wins: the body's session_id, then the X-Session-Id header.
    both = {**chat, "prompt_cache_key": "pck-2", "session_id": "sid-2"}
    assert served.post("/v1/chat/completions", both).status_code == 200
    assert (served.release("sid-2"), served.release("pck-2")) == (200, 404)
    headed = served.http.post(
        "/v1/chat/completions", json={**chat, "prompt_cache_key": "pck-3"}, headers={"X-Session-Id": "hdr-3"}
    )
    assert headed.status_code == 200
    assert (served.release("hdr-3"), served.release("pck-3")) == (200, 404)
    # Responses: the key names a stored chain's session too (instead of the first response's id).
    reply = served.post("/v1/responses", {"input": "hi", "max_output_tokens": 1, "prompt_cache_key": "pck-4"})
    assert reply.status_code == 200 and served.release("pck-4") == 200
