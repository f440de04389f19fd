"""`--prompt-layout`: the tool block moved before the system text, exactly, or the template's order kept."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import pytest

from swarmkv.api.chat_request import parse_chat_request
from swarmkv.api.layout import find_tool_block, resolve_layout, tools_first
from swarmkv.api.messages_request import parse_messages_request
from swarmkv.api.pin_request import PinRequest
from swarmkv.api.render import render_chat, render_pin
from swarmkv.tokenizer import Tokenizer
from swarmkv.tokenizer.chat import ChatTemplate

# Tools as the harnesses send them (shaped after Qwen Code's and Claude Code's first requests).
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Reads a file from the local filesystem. The path must be absolute.",
            "parameters": {
                "type": "object",
                "properties": {
                    "absolute_path": {"type": "string", "description": "The absolute path of the file"},
                    "offset": {"type": "number"},
                },
                "required": ["absolute_path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_shell_command",
            "description": "Runs a bash command and returns its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
                "required": ["command"],
            },
        },
    },
]


def _system(workdir: str) -> str:
    return (
        "You are Qwen Code, an interactive CLI agent.\n\n# Environment\n"
        f"Working directory: {workdir}\nMemory: {workdir}/.qwen/QWEN.md\nGit HEAD: 3f2a9c1\n"
    )


def _chat(workdir: str, tools: list[dict[str, Any]] | None = TOOLS) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "m",
        "messages": [
            {"role": "system", "content": _system(workdir)},
            {"role": "user", "content": "list the files"},
        ],
    }
    if tools is not None:
        body["tools"] = tools
    return body


def test_auto_is_tools_first_on_every_api() -> None:
    """Qwen Code (chat) shared 30% of its first request under the template's order by default."""
    assert resolve_layout("auto", "messages") == "tools-first"
    assert resolve_layout("auto", "chat") == "tools-first"
    assert resolve_layout("auto", "responses") == "tools-first"
    assert resolve_layout("tools-first", "chat") == "tools-first"
    assert resolve_layout("template", "messages") == "template"


def test_qwen3_tools_first_is_the_templates_text_with_the_block_moved(qwen: Tokenizer) -> None:
    req = parse_chat_request(_chat("/home/a/work"))
    template = render_chat(qwen, req).text
    moved = render_chat(qwen, req, layout="tools-first").text
    system = _system("/home/a/work")
    start = "<|im_start|>system\n"
    block_start = template.index("# Tools")
    block_end = template.index("</tool_call><|im_end|>") + len("</tool_call>")
    block = template[block_start:block_end]
    # The template's own order: system text, a blank line, the tools; tools-first swaps the two around it.
    assert template.startswith(start + system + "\n\n" + block + "<|im_end|>\n")
    assert moved == start + block + "\n\n" + system + template[block_end:]
    assert sorted(moved) == sorted(template)  # nothing added or lost


def test_two_system_texts_share_the_whole_tool_block(qwen: Tokenizer) -> None:
    a = render_chat(qwen, parse_chat_request(_chat("/home/a/work")), layout="tools-first")
    b = render_chat(qwen, parse_chat_request(_chat("/home/b/elsewhere")), layout="tools-first")
    block = find_tool_block(qwen, TOOLS)
    assert block is not None
    tools_head = qwen.encode(block.tools_head)
    shared = len(os.path.commonprefix([a.token_ids, b.token_ids]))
    assert a.token_ids[: len(tools_head)] == tools_head
    assert shared >= len(tools_head) > 200  # the schemas' tokens, all shared
    # In the template's order the paths come first, so the two share only the system text's opening.
    ta = render_chat(qwen, parse_chat_request(_chat("/home/a/work"))).token_ids
    tb = render_chat(qwen, parse_chat_request(_chat("/home/b/elsewhere"))).token_ids
    assert len(os.path.commonprefix([ta, tb])) < 30


def test_tools_first_is_stable_across_turns(qwen: Tokenizer) -> None:
    turn1 = _chat("/home/a/work")
    turn2 = {**turn1, "messages": [*turn1["messages"], {"role": "assistant", "content": "ok"}]}
    turn2["messages"].append({"role": "user", "content": "and now?"})
    one = render_chat(qwen, parse_chat_request(turn1), layout="tools-first")
    two = render_chat(qwen, parse_chat_request(turn2), layout="tools-first")
    head = one.text.removesuffix("<|im_start|>assistant\n")
    assert two.text.startswith(head)


@pytest.mark.parametrize(
    "body",
    [
        _chat("/w", tools=None),
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS},
    ],
)
def test_nothing_to_move_keeps_the_template(qwen: Tokenizer, body: dict[str, Any]) -> None:
    req = parse_chat_request(body)
    assert render_chat(qwen, req, layout="tools-first").text == render_chat(qwen, req).text


def test_smollm2_has_no_tool_block_of_its_own_so_tools_first_is_the_template(smol: Tokenizer) -> None:
    req = parse_chat_request(_chat("/home/a/work"))
    assert find_tool_block(smol, TOOLS) is None
    assert render_chat(smol, req, layout="tools-first").text == render_chat(smol, req).text


SYSTEM_IN_OWN_TURN = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS_BEFORE_SYSTEM = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }} {% endfor %}\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)
TOOLS_IN_LAST_USER_TURN = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% if loop.last and tools %}\n\nTools: {{ tools | tojson }}{% endif %}<|im_end|>\n{% endfor %}"
)


@pytest.mark.parametrize("source", [SYSTEM_IN_OWN_TURN, TOOLS_BEFORE_SYSTEM, TOOLS_IN_LAST_USER_TURN])
def test_a_template_whose_block_cannot_be_found_after_the_system_text_falls_back(
    qwen: Tokenizer, source: str
) -> None:
    tokenizer = _with_template(qwen, source)
    req = parse_chat_request(_chat("/home/a/work"))
    assert find_tool_block(tokenizer, TOOLS) is None
    assert render_chat(tokenizer, req, layout="tools-first").text == render_chat(tokenizer, req).text


def test_a_system_text_the_template_rewrites_falls_back(qwen: Tokenizer) -> None:
    assert qwen.template is not None
    source = qwen.template.source.replace(
        "messages[0].content + '\\n\\n'", "messages[0].content | upper + '\\n\\n'"
    )
    assert source != qwen.template.source
    tokenizer = _with_template(qwen, source)
    req = parse_chat_request(_chat("/home/a/work"))
    assert find_tool_block(tokenizer, TOOLS) is None  # the probe's sentinel text is rewritten too
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS)
    assert tools_first(tokenizer, messages, TOOLS, text) is None
    assert render_chat(tokenizer, req, layout="tools-first").text == render_chat(tokenizer, req).text


def test_pins_are_prefixes_of_the_tools_first_prompt(qwen: Tokenizer) -> None:
    tools = [{**t} for t in TOOLS]
    body = {
        "model": "m",
        "max_tokens": 10,
        "system": [{"type": "text", "text": _system("/home/a/work"), "cache_control": {"type": "ephemeral"}}],
        "tools": [
            {
                "name": t["function"]["name"],
                "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"],
            }
            for t in tools
        ],
        "messages": [{"role": "user", "content": "list the files"}],
    }
    req = parse_messages_request(body)
    prompt = render_chat(qwen, req.chat, layout="tools-first").token_ids
    assert len(req.breakpoints) == 1
    pin = PinRequest(None, req.breakpoints[0].messages, req.chat.prompt_tools, None, None, None)
    ids = render_pin(qwen, pin, layout="tools-first")
    assert prompt[: len(ids)] == ids and len(ids) > 200
    # In the template's order that pin would not be a prefix of the tools-first prompt.
    assert prompt[: len(render_pin(qwen, pin))] != render_pin(qwen, pin)
    tools_only = render_pin(
        qwen, PinRequest(None, [], req.chat.prompt_tools, None, None, None), "tools-first"
    )
    block = find_tool_block(qwen, req.chat.prompt_tools or [])
    assert block is not None and tools_only == qwen.encode(block.tools_head)
    assert prompt[: len(tools_only)] == tools_only


def _with_template(tokenizer: Tokenizer, source: str) -> Tokenizer:
    """A copy of `tokenizer` whose chat template is `source`."""
    assert tokenizer.template is not None
    return dataclasses.replace(
        tokenizer, template=ChatTemplate(source, None, tokenizer.template.special_tokens)
    )


def test_serve_has_the_flag_and_the_config_keeps_it() -> None:
    import argparse

    from swarmkv.server.cli import add_server_arguments, server_config
    from swarmkv.server.config import ServerConfig

    assert ServerConfig().prompt_layout == "auto"
    parser = argparse.ArgumentParser()
    add_server_arguments(parser)
    assert server_config(parser.parse_args(["--prompt-layout", "tools-first"])).prompt_layout == "tools-first"
    with pytest.raises(SystemExit):
        parser.parse_args(["--prompt-layout", "sideways"])


def test_lint_and_the_router_render_as_the_server_does(qwen: Tokenizer) -> None:
    import json

    from swarmkv.api.paths import CHAT_ROUTE, MESSAGES_ROUTE
    from swarmkv.cluster.route_key import RouteKeyer
    from swarmkv.lint.log_file import LoggedRequest
    from swarmkv.lint.render import Renderer

    body = _chat("/home/a/work")
    req = parse_chat_request(body)
    template = render_chat(qwen, req).token_ids
    moved = render_chat(qwen, req, layout="tools-first").token_ids
    assert moved != template
    logged = LoggedRequest(0, 1, CHAT_ROUTE, body)
    assert Renderer(qwen).render(logged).prompt.token_ids == moved  # auto is tools-first on every API
    assert Renderer(qwen, prompt_layout="template").render(logged).prompt.token_ids == template
    keyer = RouteKeyer(qwen)  # auto
    assert list(keyer.route("POST", CHAT_ROUTE, {}, json.dumps(body).encode()).key.tokens) == moved
    templated = RouteKeyer(qwen, prompt_layout="template")
    assert list(templated.route("POST", CHAT_ROUTE, {}, json.dumps(body).encode()).key.tokens) == template
    messages_body = {
        "model": "m",
        "max_tokens": 10,
        "system": _system("/home/a/work"),
        "tools": [
            {
                "name": t["function"]["name"],
                "description": t["function"]["description"],
                "input_schema": t["function"]["parameters"],
            }
            for t in TOOLS
        ],
        "messages": [{"role": "user", "content": "list the files"}],
    }
    msg = parse_messages_request(messages_body)
    expected = render_chat(qwen, msg.chat, layout="tools-first").token_ids
    assert expected != render_chat(qwen, msg.chat).token_ids
    routed = keyer.route("POST", MESSAGES_ROUTE, {}, json.dumps(messages_body).encode())
    assert list(routed.key.tokens) == expected
    forced = RouteKeyer(qwen, prompt_layout="template")
    assert (
        list(forced.route("POST", MESSAGES_ROUTE, {}, json.dumps(messages_body).encode()).key.tokens)
        != expected
    )


def _anthropic_tools() -> list[dict[str, Any]]:
    return [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]


@pytest.fixture(scope="module")
def scripted_llm(scripted_model_dir: Any) -> Any:
    from swarmkv.engine.llm import LLM

    return LLM(
        str(scripted_model_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=8192, max_num_seqs=2
    )


@pytest.mark.parametrize("layout", ["auto", "template"])
def test_a_second_instance_reads_the_tools_from_the_cache_on_messages(scripted_llm: Any, layout: str) -> None:
    import httpx

    from swarmkv.server import ServerConfig, create_app
    from swarmkv.server.background import BackgroundServer

    app = create_app(scripted_llm, ServerConfig(prompt_layout=layout))  # type: ignore[arg-type]
    tokenizer = scripted_llm.tokenizer
    block = find_tool_block(tokenizer, TOOLS)
    assert block is not None  # the scripted checkpoint's template renders tools as Qwen3's does
    num_tools_tokens = len(tokenizer.encode(block.tools_head))
    reads = []
    with BackgroundServer(app) as server:
        for workdir in (f"/home/a/{layout}", f"/home/b/{layout}"):
            body = {
                "model": "scripted",
                "max_tokens": 1,
                "system": _system(workdir),
                "tools": _anthropic_tools(),
                "messages": [{"role": "user", "content": "list the files"}],
            }
            response = httpx.post(server.url + "/v1/messages", json=body, timeout=600)
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            reads.append(usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"])
        app.state.ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=600)
    if layout == "auto":  # tools-first on Messages: the second instance shares all but the last partial page
        assert reads[1] >= num_tools_tokens - 64
    else:  # the template's order: only the system text's opening, up to the first per-instance path
        opening = len(tokenizer.encode(block.head + _system("/home/").split("/home/")[0] + "/home/"))
        assert reads[1] <= opening < num_tools_tokens / 4
