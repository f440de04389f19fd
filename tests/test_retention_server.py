"""The server tells the engine which tool each session's reply called, from the reply it parsed."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from swarmkv import LLM
from swarmkv.models.loader import LoadedModel, load_model
from swarmkv.server import create_app
from swarmkv.server.background import BackgroundServer

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    for name in ("get_weather", "get_time")
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def scripted(scripted_model_dir: Path) -> LoadedModel:
    return load_model(scripted_model_dir, dtype="float32")


def _pending_tool(llm: LLM, session: str) -> str | None:
    """The engine's pending tool for `session`, once the server's note (queued after the reply) has run."""
    retention = llm.engine.core.kv.retention
    for _ in range(200):
        if retention.pending_tool(session) is not None:
            break
        time.sleep(0.01)
    return retention.pending_tool(session)


def _reply_and_pending_tool(
    scripted: LoadedModel, path: str, body: dict[str, Any], session: str
) -> tuple[httpx.Response, str | None]:
    """POST `body` to `path` on a fresh server as `session`; the response and the engine's pending tool after it."""
    llm = LLM(loaded=scripted, kv_cache_memory="16MiB", max_num_seqs=4, retention="return")
    with BackgroundServer(create_app(llm)) as server:
        headers = {"X-Session-Id": session}
        response = httpx.post(f"{server.url}{path}", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        return response, _pending_tool(llm, session)


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_reply_s_tool_call_reaches_the_engine(scripted: LoadedModel, stream: bool) -> None:
    body = {
        "model": scripted.name,
        "messages": QUESTION,
        "tools": TOOLS,
        "temperature": 0,
        "stream": stream,
    }
    response, pending = _reply_and_pending_tool(scripted, "/v1/chat/completions", body, f"agent-{stream}")
    assert "get_weather" in response.text
    assert pending == "get_weather"


def test_a_messages_reply_s_tool_call_reaches_the_engine(scripted: LoadedModel) -> None:
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]} for t in TOOLS]
    body = {
        "model": scripted.name,
        "messages": QUESTION,
        "tools": tools,
        "max_tokens": 64,
        "temperature": 0,
    }
    response, pending = _reply_and_pending_tool(scripted, "/v1/messages", body, "claude")
    assert response.json()["stop_reason"] == "tool_use"
    assert pending == "get_weather"
