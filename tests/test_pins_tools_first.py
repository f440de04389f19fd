"""Under the tools-first layout a Messages `cache_control` mark on the last tool pins the rendered tools alone:
the prompt's head up to the tool block's end, as Anthropic's cache orders tools, then system, then messages.
So two agents whose system texts differ (a path, a working directory) share that pin, and the second reads
the tool block from the cache after the first's unmarked system text was evicted. Where the prompt keeps the
template's order (the `template` layout, or a template with no tool block of its own) the mark still pins the
system turn the tools are rendered in.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from swarmkv import LLM, SamplingParams
from swarmkv.api.layout import find_tool_block
from swarmkv.api.messages_request import MessagesRequest, parse_messages_request
from swarmkv.api.render import render_chat, render_pin
from swarmkv.tokenizer import Tokenizer
from tiny_models import make_tiny_checkpoint

BLOCK = 16
EPHEMERAL = {"type": "ephemeral"}
TOOLS: list[dict[str, Any]] = [
    {
        "name": "read_file",
        "description": "Reads a file from the local filesystem. The path must be absolute.",
        "input_schema": {
            "type": "object",
            "properties": {
                "absolute_path": {"type": "string", "description": "The absolute path of the file"},
                "offset": {"type": "number"},
            },
            "required": ["absolute_path"],
        },
    },
    {
        "name": "run_shell_command",
        "description": "Runs a bash command and returns its output.",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
            "required": ["command"],
        },
    },
]


def _body(workdir: str) -> dict[str, Any]:
    """Claude Code's shape: per-instance text in the system prompt, a mark on the last tool only."""
    *head, last = TOOLS
    system = f"You are an interactive CLI agent.\n\nWorking directory: {workdir}\nGit HEAD: 3f2a9c1\n"
    return {
        "model": "tiny",
        "max_tokens": 4,
        "system": system,
        "tools": [*head, {**last, "cache_control": EPHEMERAL}],
        "messages": [{"role": "user", "content": "list the files"}],
    }


def _tool_mark(body: dict[str, Any]) -> tuple[MessagesRequest, Any]:
    req = parse_messages_request(body)
    (mark,) = req.breakpoints
    assert mark.on_tools
    return req, mark


# Tiny tensors run fastest on one thread on a shared CPU (conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 with the Qwen3 tokenizer, whose template renders a tool block of its own."""
    folder = tmp_path_factory.mktemp("tools-first") / "qwen3"
    return make_tiny_checkpoint(folder, "qwen3", max_position_embeddings=1024)


def test_a_mark_on_the_last_tool_pins_the_tools_alone_and_a_second_system_reads_them(folder: Path) -> None:
    probe = LLM(model=str(folder), dtype="float32", kv_cache_memory="1MiB", block_size=BLOCK)
    page_bytes = probe.stats()["kv_bytes_per_token"] * BLOCK
    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory=48 * page_bytes, block_size=BLOCK)
    engine = llm.engine
    tokenizer = llm.tokenizer
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    req_a, mark_a = _tool_mark(_body("/home/a/work"))
    ids = render_pin(tokenizer, req_a.pin_request(mark_a, tokenizer, "tools-first"), "tools-first")
    block = find_tool_block(tokenizer, req_a.chat.prompt_tools or [])
    assert block is not None and ids == tokenizer.encode(block.tools_head, add_special_tokens=False)
    prompt_a = render_chat(tokenizer, req_a.chat, layout="tools-first").token_ids
    assert prompt_a[: len(ids)] == ids and len(prompt_a) - len(ids) > 2 * BLOCK  # a system part after it

    pin = llm.pin(ids, ttl_s=300)
    num_pinned = pin.num_tokens
    assert num_pinned == len(ids) // BLOCK * BLOCK > 10 * BLOCK
    (out_a,) = llm.generate([prompt_a], greedy)
    assert out_a.num_cached_tokens >= num_pinned  # and the tools' last, partial page the pin's prefill left
    # Other traffic evicts every unpinned page: the first agent's system text and question are gone.
    rng = random.Random(0)
    room = (engine.core.kv.num_pages - engine.core.kv.num_pinned - 2) * BLOCK
    for _ in range(2):
        llm.generate([[rng.randrange(1000) for _ in range(room)]], SamplingParams(max_tokens=1))
    assert engine.core.kv.lookup(prompt_a[:-1], None).num_tokens == num_pinned

    req_b, mark_b = _tool_mark(_body("/home/b/elsewhere"))
    ids_b = render_pin(tokenizer, req_b.pin_request(mark_b, tokenizer, "tools-first"), "tools-first")
    assert ids_b == ids  # the same prefix, pinned anew once the first pin is gone
    assert llm.unpin(pin.pin_id)
    again = llm.pin(ids_b, ttl_s=300)
    # Its whole pages were held all along; the tools' last, partial page was evicted and computed again.
    assert (again.num_tokens, again.num_created_tokens) == (num_pinned, len(ids) - num_pinned)
    prompt_b = render_chat(tokenizer, req_b.chat, layout="tools-first").token_ids
    (out_b,) = llm.generate([prompt_b], greedy)
    assert out_b.num_cached_tokens >= num_pinned  # the tool block, read from the cache
    assert prompt_b[:num_pinned] == prompt_a[:num_pinned] and prompt_b != prompt_a
    assert llm.unpin(again.pin_id)
    assert engine.core.kv.num_pinned == 0
    engine.check_integrity()


def test_a_tool_mark_pins_the_system_turn_where_the_template_order_stands(
    qwen: Tokenizer, smol: Tokenizer
) -> None:
    req, mark = _tool_mark(_body("/home/a/work"))
    system_turn = req.chat.messages[:1]
    assert mark.messages == system_turn
    assert req.pin_request(mark, qwen, "template").messages == system_turn
    assert req.pin_request(mark, qwen, "tools-first").messages == []  # the tools alone
    # SmolLM2's template has no tool block of its own: tools-first keeps the template's order there.
    assert req.pin_request(mark, smol, "tools-first").messages == system_turn
    for tokenizer in (qwen, smol):  # whatever is pinned is a prefix of the prompt it marks
        for layout in ("template", "tools-first"):
            pin = render_pin(tokenizer, req.pin_request(mark, tokenizer, layout), layout)
            assert render_chat(tokenizer, req.chat, layout=layout).token_ids[: len(pin)] == pin
    # With no system text the tools are the head of every such chat in either layout, as before.
    body = _body("/w")
    del body["system"]
    req, mark = _tool_mark(body)
    assert mark.messages == [] and req.pin_request(mark, qwen, "tools-first").messages == []


def test_over_http_a_second_agent_reads_the_pinned_tools(folder: Path) -> None:
    # The Messages route pins what the mark covers: the tools alone (server default layout: auto, tools-first).
    import httpx

    from swarmkv.server import create_app
    from swarmkv.server.background import BackgroundServer

    llm = LLM(model=str(folder), dtype="float32", kv_cache_memory="4MiB", block_size=BLOCK)
    req, mark = _tool_mark(_body("/home/a/work"))
    tokenizer = llm.tokenizer
    num_tools = len(render_pin(tokenizer, req.pin_request(mark, tokenizer, "tools-first"), "tools-first"))
    with BackgroundServer(create_app(llm)) as server:
        usages = []
        for workdir in ("/home/a/work", "/home/b/elsewhere"):
            body = {**_body(workdir), "model": "qwen3"}
            reply = httpx.post(f"{server.url}/v1/messages", json=body, timeout=120)
            assert reply.status_code == 200, reply.text
            usages.append(reply.json()["usage"])
    first, second = usages
    assert first["cache_creation_input_tokens"] >= num_tools // BLOCK * BLOCK
    assert second["cache_read_input_tokens"] >= num_tools // BLOCK * BLOCK
    assert second["cache_creation_input_tokens"] == 0  # the pin was the first agent's: nothing new to pin
    llm.engine.check_integrity()
