"""Agent frameworks end to end against swarmkv's server, run as their users run them: the OpenAI Agents SDK
on the Responses API and the Anthropic client's tool runner on the Messages API, each looping over two tools.

The model is the scripted checkpoint (tests/scripted_model.py), so every run is the same on every machine:
it calls get_weather(city="Paris") when the user spoke last, completes whatever call the server forces,
and answers ANSWER after tool results. Left to itself the loop is one call and the answer; the two-tool
loops name the tool each turn must call (the frameworks' own `tool_choice`), moved on by the framework's
hooks: first get_weather, then get_time, then none, which ends the loop with the scripted answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    RunHooks,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from anthropic import beta_tool

from scripted_model import ANSWER, CITY
from swarmkv.engine.llm import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext

pytestmark = pytest.mark.e2e  # each test runs a real server

API_KEY = "test-key"
QUESTION = "What is the weather and the time in Paris?"
INSTRUCTIONS = "You answer questions about cities using the tools. Answer in one short sentence."
CITY_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string", "description": "The city"}},
    "required": ["city"],
}
# The tool each turn must call, after the named one ran; "none" lets the model answer.
NEXT_TOOL = {"get_weather": "get_time", "get_time": "none"}


@dataclass(frozen=True)
class Served:
    url: str
    ctx: ServerContext

    @property
    def model(self) -> str:
        return self.ctx.model_name

    def cached_tokens(self) -> int:
        return self.ctx.engine.call(lambda e: e.stats()["prefix_hit_tokens"]).result(timeout=30)


@pytest.fixture(scope="module")
def served(scripted_model_dir: Path) -> Iterator[Served]:
    set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers
    llm = LLM(
        str(scripted_model_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=4096, max_num_seqs=8
    )
    app = create_app(llm, ServerConfig(api_key=API_KEY))
    with BackgroundServer(app) as server:
        ctx: ServerContext = app.state.ctx
        yield Served(server.url, ctx)
        ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=30)


def _agents_sdk_tools(calls: list[tuple[str, str]]) -> list[Any]:
    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(("get_weather", city))
        return "Sunny, 21 C"

    @function_tool
    def get_time(city: str) -> str:
        """Get the local time in a city."""
        calls.append(("get_time", city))
        return "14:05"

    return [get_weather, get_time]


class _NextTool(RunHooks):
    """Moves the agent's tool_choice on after each tool runs, as an application steering its agent would."""

    async def on_tool_end(self, context: Any, agent: Agent[Any], tool: Any, result: object) -> None:
        agent.model_settings = agent.model_settings.resolve(ModelSettings(tool_choice=NEXT_TOOL[tool.name]))


@pytest.mark.parametrize("streamed", [False, True])
def test_openai_agents_sdk_runs_a_two_tool_loop(served: Served, streamed: bool) -> None:
    calls: list[tuple[str, str]] = []
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    agent = Agent(
        name="city-helper",
        instructions=INSTRUCTIONS,
        tools=_agents_sdk_tools(calls),
        model=OpenAIResponsesModel(model=served.model, openai_client=client),
        model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=128),
        reset_tool_choice=False,
    )

    async def run() -> Any:
        if not streamed:
            return await Runner.run(agent, QUESTION, hooks=_NextTool(), max_turns=5)
        result = Runner.run_streamed(agent, QUESTION, hooks=_NextTool(), max_turns=5)
        kinds = {event.type async for event in result.stream_events()}
        assert "raw_response_event" in kinds and "run_item_stream_event" in kinds
        return result

    before = served.cached_tokens()
    result = asyncio.run(run())
    assert calls == [("get_weather", CITY), ("get_time", CITY)]
    assert result.final_output == ANSWER
    assert len(result.raw_responses) == 3
    # Each turn resends the conversation; its head is served from the prefix cache.
    later = [r.usage.input_tokens_details.cached_tokens for r in result.raw_responses[1:]]
    assert all(cached > 0 for cached in later), later
    assert served.cached_tokens() - before >= sum(later)


def test_openai_agents_sdk_runs_a_loop_its_model_drives(served: Served) -> None:
    # No tool_choice: the model writes the call itself, the server parses it from the reply, and the agent
    # ends on the model's answer to the tool's result.
    calls: list[tuple[str, str]] = []
    client = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    agent = Agent(
        name="city-helper",
        instructions=INSTRUCTIONS,
        tools=_agents_sdk_tools(calls),
        model=OpenAIResponsesModel(model=served.model, openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=128),
    )
    result = asyncio.run(Runner.run(agent, QUESTION, max_turns=5))
    assert calls == [("get_weather", CITY)]
    assert result.final_output == ANSWER
    assert len(result.raw_responses) == 2


def _anthropic_tools(calls: list[tuple[str, str]]) -> list[Any]:
    @beta_tool(name="get_weather", description="Get the current weather in a city.", input_schema=CITY_SCHEMA)
    def get_weather(city: str) -> str:
        calls.append(("get_weather", city))
        return "Sunny, 21 C"

    @beta_tool(name="get_time", description="Get the local time in a city.", input_schema=CITY_SCHEMA)
    def get_time(city: str) -> str:
        calls.append(("get_time", city))
        return "14:05"

    return [get_weather, get_time]


@pytest.mark.parametrize("streamed", [False, True])
def test_anthropic_tool_runner_runs_a_two_tool_loop(served: Served, streamed: bool) -> None:
    calls: list[tuple[str, str]] = []
    client = anthropic.Anthropic(base_url=served.url, api_key=API_KEY, max_retries=0, timeout=120)
    runner: Any = client.beta.messages.tool_runner(
        model=served.model,
        max_tokens=64,
        tools=_anthropic_tools(calls),
        messages=[{"role": "user", "content": QUESTION}],
        system=INSTRUCTIONS,
        tool_choice={"type": "tool", "name": "get_weather"},
        thread=False,  # swarmkv has no server-side message threads: each turn sends the whole history
        stream=streamed,
        extra_body={"temperature": 0},
    )
    replies = []
    for turn in runner:
        reply = turn.get_final_message() if streamed else turn
        replies.append(reply)
        if reply.stop_reason == "tool_use":
            (block,) = reply.content
            nxt = NEXT_TOOL[block.name]
            choice = {"type": "none"} if nxt == "none" else {"type": "tool", "name": nxt}
            runner.set_messages_params(lambda params, choice=choice: {**params, "tool_choice": choice})
    assert calls == [("get_weather", CITY), ("get_time", CITY)]
    assert [r.stop_reason for r in replies] == ["tool_use", "tool_use", "end_turn"]
    assert [block.text for block in replies[-1].content if block.type == "text"] == [ANSWER]
    assert all(r.usage.cache_read_input_tokens > 0 for r in replies[1:])


def test_anthropic_tool_runner_runs_a_loop_its_model_drives(served: Served) -> None:
    calls: list[tuple[str, str]] = []
    client = anthropic.Anthropic(base_url=served.url, api_key=API_KEY, max_retries=0, timeout=120)
    runner: Any = client.beta.messages.tool_runner(
        model=served.model,
        max_tokens=64,
        tools=_anthropic_tools(calls),
        messages=[{"role": "user", "content": QUESTION}],
        system=INSTRUCTIONS,
        thread=False,
        extra_body={"temperature": 0},
    )
    replies = list(runner)
    assert calls == [("get_weather", CITY)]
    assert [r.stop_reason for r in replies] == ["tool_use", "end_turn"]
    assert [block.text for block in replies[-1].content if block.type == "text"] == [ANSWER]


def test_the_default_threaded_tool_runner_falls_back_to_whole_histories(served: Served) -> None:
    # The client threads by default; swarmkv's refusal carries the error code that makes it go on unthreaded.
    calls: list[tuple[str, str]] = []
    client = anthropic.Anthropic(base_url=served.url, api_key=API_KEY, max_retries=0, timeout=120)
    runner: Any = client.beta.messages.tool_runner(
        model=served.model,
        max_tokens=64,
        tools=_anthropic_tools(calls)[:1],
        messages=[{"role": "user", "content": QUESTION}],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    )
    replies = []
    for reply in runner:
        replies.append(reply)
        runner.set_messages_params(lambda params: {**params, "tool_choice": {"type": "none"}})
    assert calls == [("get_weather", CITY)]
    assert [r.stop_reason for r in replies] == ["tool_use", "end_turn"]
    assert [block.text for block in replies[-1].content if block.type == "text"] == [ANSWER]
    refused = httpx.post(
        f"{served.url}/v1/messages",
        json={
            "model": served.model,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi"}],
            "thread": {"type": "create"},
        },
        headers={"x-api-key": API_KEY},
        timeout=60,
    )
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["details"] == {"error_code": "thread_unsupported_request", "unsupported": ["thread"]}
