"""Prompts the size of a real coding harness's first request (16K+ tokens) through the Messages and Responses
APIs, on a tiny random model with 32K positions: two agents opening with the same head share its KV, and a
continued conversation prefills only its new items."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest

from harness_prompt import as_function_tools, harness_head
from swarmkv.engine.llm import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext
from tiny_models import make_tiny_checkpoint

API_KEY = "test-key"
HARNESS_TOKENS = 16_000  # the least a real harness's head counts
TASKS = ("Fix the failing test in tests/test_kv.py.", "Add a --dry-run flag to the CLI.")


@dataclass(frozen=True)
class Served:
    url: str
    ctx: ServerContext

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=API_KEY, max_retries=0, timeout=300)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny32k"), "qwen3", max_position_embeddings=32768)
    llm = LLM(model=str(folder), max_model_len=32768, kv_cache_memory="96MiB", max_num_seqs=4)
    app = create_app(llm, ServerConfig(api_key=API_KEY, served_model_name="tiny"))
    with BackgroundServer(app) as server:
        ctx: ServerContext = app.state.ctx
        yield Served(server.url, ctx)
        ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=30)


def _messages_body(task: str) -> dict[str, Any]:
    system, tools, reminder = harness_head()
    return {
        "model": "tiny",
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "tools": tools,
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": reminder}, {"type": "text", "text": task}]}
        ],
        "max_tokens": 2,
    }


def test_two_agents_share_a_harness_head_through_messages(served: Served) -> None:
    client = served.anthropic()
    first_body = _messages_body(TASKS[0])
    counted = client.messages.count_tokens(**{k: v for k, v in first_body.items() if k != "max_tokens"})
    assert counted.input_tokens >= HARNESS_TOKENS
    first = client.messages.create(**first_body)
    total = (
        first.usage.input_tokens
        + first.usage.cache_read_input_tokens
        + first.usage.cache_creation_input_tokens
    )
    assert total == counted.input_tokens
    # The system block's mark pins the head the template renders first: the system prompt with the tools.
    assert first.usage.cache_creation_input_tokens > HARNESS_TOKENS // 2
    second = client.messages.create(**_messages_body(TASKS[1]))
    head = first.usage.cache_creation_input_tokens
    assert second.usage.cache_read_input_tokens >= head
    assert second.usage.input_tokens < counted.input_tokens - head + 64  # the reminder and its own task


def test_a_responses_chain_at_harness_size_prefills_only_new_items(served: Served) -> None:
    system, tools, reminder = harness_head()
    client = served.openai()
    kwargs: dict[str, Any] = {"model": "tiny", "instructions": system, "tools": as_function_tools(tools)}
    first = client.responses.create(input=f"{reminder}\n{TASKS[0]}", max_output_tokens=2, **kwargs)
    assert first.usage is not None and first.usage.input_tokens >= HARNESS_TOKENS
    second = client.responses.create(input=f"{reminder}\n{TASKS[1]}", max_output_tokens=2, **kwargs)
    assert second.usage is not None
    assert second.usage.input_tokens_details.cached_tokens >= HARNESS_TOKENS // 2  # the shared head
    turn = client.responses.create(
        input="Now run the tests.", previous_response_id=first.id, max_output_tokens=2, **kwargs
    )
    assert turn.usage is not None
    new_tokens = turn.usage.input_tokens - turn.usage.input_tokens_details.cached_tokens
    assert turn.usage.input_tokens > first.usage.input_tokens
    assert new_tokens < 64, new_tokens  # the new item and the template's turn markers
