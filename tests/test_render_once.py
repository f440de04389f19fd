"""Compute once (issue 52, item 5): a Messages request goes through the chat template at most twice under
tools-first, layout and cache marks included; its tools are parsed once; its pins reach the engine thread
in the one command that carries the request."""

from __future__ import annotations

from typing import Any

import pytest

from swarmkv.api import chat_request, messages_request
from swarmkv.api.messages_request import parse_messages_request
from swarmkv.api.render import render_messages, render_pin, render_request
from swarmkv.tokenizer import Tokenizer
from swarmkv.tokenizer.chat import ChatTemplate

EPHEMERAL = {"type": "ephemeral"}
TOOLS: list[dict[str, Any]] = [
    {
        "name": "read_file",
        "description": "Reads a file from the local filesystem. The path must be absolute.",
        "input_schema": {
            "type": "object",
            "properties": {"absolute_path": {"type": "string"}, "offset": {"type": "number"}},
            "required": ["absolute_path"],
        },
    },
    {
        "name": "run_shell_command",
        "description": "Runs a bash command and returns its output.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    },
]
SYSTEM = "You are an interactive CLI agent.\n\nWorking directory: /home/a/work\nGit HEAD: 3f2a9c1\n"


def _body(mark: str) -> dict[str, Any]:
    """Tools, a system prompt, a conversation, and one cache_control mark `mark` (tools, system or user)."""
    tools = [dict(t) for t in TOOLS]
    system: Any = SYSTEM
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "list the files"},
        {"role": "assistant", "content": "Here they are."},
        {"role": "user", "content": "now read the first"},
    ]
    if mark == "tools":
        tools[-1]["cache_control"] = EPHEMERAL
    elif mark == "system":
        system = [{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}]
    else:
        messages[-1]["content"] = [{"type": "text", "text": "now read the first", "cache_control": EPHEMERAL}]
    return {"model": "m", "max_tokens": 8, "system": system, "tools": tools, "messages": messages}


class _Renders:
    """Counts calls of the chat template's render, layout probes included."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        render = ChatTemplate.render

        def counted(template: ChatTemplate, *args: Any, **kwargs: Any) -> str:
            self.count += 1
            return render(template, *args, **kwargs)

        monkeypatch.setattr(ChatTemplate, "render", counted)


@pytest.mark.parametrize("mark", ["tools", "system", "user"])
def test_a_tools_first_messages_request_with_a_mark_renders_at_most_twice(
    qwen: Tokenizer, monkeypatch: pytest.MonkeyPatch, mark: str
) -> None:
    req = parse_messages_request(_body(mark))
    assert len(req.breakpoints) == 1
    # What the prompt and the pin were before: the prompt alone, and each pin by its own rendering.
    _, prompt = render_request(qwen, req.chat, "tools-first")
    pin = render_pin(qwen, req.pin_request(req.breakpoints[0], qwen, "tools-first"), "tools-first")
    renders = _Renders(monkeypatch)
    rendered = render_messages(qwen, req, "tools-first")
    assert renders.count <= 2  # was 8 to 10: 4 for the prompt, 4 to 6 for the mark
    assert rendered.prompt.token_ids == prompt.token_ids and rendered.prompt.text == prompt.text
    assert rendered.pins == [pin]
    assert prompt.token_ids[: len(pin)] == pin and len(pin) > 100  # the tools (and more) lead


def test_a_tools_first_prompt_without_marks_renders_twice_and_the_template_order_once(
    qwen: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    req = parse_messages_request({**_body("tools"), "tools": TOOLS})
    renders = _Renders(monkeypatch)
    render_messages(qwen, req, "tools-first")
    assert renders.count == 2  # the prompt, and its system turn without the tools: where the block ends
    renders.count = 0
    render_messages(qwen, req, "template")
    assert renders.count == 1


def test_a_messages_requests_tools_are_parsed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    parse_tools = chat_request.parse_tools

    def counted(tools: Any, *rest: Any) -> Any:
        calls.append(tools)
        return parse_tools(tools, *rest)

    monkeypatch.setattr(chat_request, "parse_tools", counted)
    monkeypatch.setattr(messages_request, "parse_tools", counted)
    req = parse_messages_request(_body("system"))
    assert len(calls) == 1
    assert [t["function"]["name"] for t in req.chat.tools or []] == ["read_file", "run_shell_command"]


@pytest.fixture(scope="module")
def scripted_llm(scripted_model_dir: Any) -> Any:
    from swarmkv.engine.llm import LLM

    return LLM(
        str(scripted_model_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=8192, max_num_seqs=2
    )


def test_a_request_and_its_pin_reach_the_engine_thread_as_one_command(
    scripted_llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import httpx

    from swarmkv.server import ServerConfig, create_app
    from swarmkv.server.background import BackgroundServer
    from swarmkv.server.engine_loop.async_engine import AsyncEngine
    from swarmkv.server.engine_loop.commands import Abort, Add

    commands: list[Any] = []
    put = AsyncEngine._put

    def recorded(engine: AsyncEngine, command: Any) -> None:
        commands.append(command)
        put(engine, command)

    monkeypatch.setattr(AsyncEngine, "_put", recorded)
    app = create_app(scripted_llm, ServerConfig())
    body = {**_body("system"), "model": "scripted", "max_tokens": 1}
    with BackgroundServer(app) as server:
        commands.clear()  # the server's own start-up calls
        response = httpx.post(server.url + "/v1/messages", json=body, timeout=600)
        assert response.status_code == 200, response.text
        # No unpin, share check or pin of its own: one command (and the no-op abort every submitted request
        # gets when its HTTP request ends, `http/disconnect.py`).
        (command,) = [c for c in commands if not isinstance(c, Abort)]
        assert isinstance(command, Add) and len(command.pins) == 1
        (pin,) = command.pins
        assert command.prompt_token_ids[: len(pin.prompt_token_ids)] == pin.prompt_token_ids
        usage = response.json()["usage"]
        # A lone request on a cold server read nothing: its mark's pin computed the whole prefix (its last,
        # partial page is cached unpinned) and the rest was this request's own input.
        assert usage["cache_read_input_tokens"] == 0
        assert usage["cache_creation_input_tokens"] == len(pin.prompt_token_ids)
        assert usage["input_tokens"] == len(command.prompt_token_ids) - len(pin.prompt_token_ids)
        again = httpx.post(server.url + "/v1/messages", json=body, timeout=600)
        assert again.json()["usage"]["cache_creation_input_tokens"] == 0  # a refreshed pin creates nothing
        app.state.ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=600)


def test_two_cold_requests_at_once_one_creates_the_other_reads(scripted_model_dir: Any) -> None:
    """Two agents' first requests, sent together to a cold server: one's mark creates the prefix, the other
    shares that pin and reads it; neither counts a read that did not happen."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from swarmkv.engine.llm import LLM
    from swarmkv.server import ServerConfig, create_app
    from swarmkv.server.background import BackgroundServer

    cold = LLM(
        str(scripted_model_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=8192, max_num_seqs=2
    )  # its own engine: a cache no other test warmed
    app = create_app(cold, ServerConfig())
    body = {**_body("system"), "model": "scripted", "max_tokens": 1}
    with BackgroundServer(app) as server:
        ctx = app.state.ctx
        hits_before = ctx.engine.snapshot().prefix_hit_tokens
        with ThreadPoolExecutor(2) as pool:
            replies = list(
                pool.map(lambda _: httpx.post(server.url + "/v1/messages", json=body, timeout=600), range(2))
            )
        usages = [r.json()["usage"] for r in replies]
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        created = sorted(u["cache_creation_input_tokens"] for u in usages)
        assert created[0] == 0 and created[1] > 0
        reader = next(u for u in usages if u["cache_creation_input_tokens"] == 0)
        creator = next(u for u in usages if u["cache_creation_input_tokens"] > 0)
        assert creator["cache_read_input_tokens"] == 0
        assert reader["cache_read_input_tokens"] >= creator["cache_creation_input_tokens"]
        prompt = {
            sum(u[k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))
            for u in usages
        }
        assert len(prompt) == 1  # the same prompt, split three ways that add up
        # What they report read is what the server served from its cache, pins' work aside.
        stats = ctx.engine.call(lambda engine: engine.snapshot()).result(timeout=600)
        reads = sum(u["cache_read_input_tokens"] + u["cache_creation_input_tokens"] for u in usages)
        assert reads == stats.prefix_hit_tokens - hits_before
        ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=600)
