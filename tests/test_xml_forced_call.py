"""A forced tool call (tool_choice "required" or a named function) opens in the model's own format: Hermes JSON
for Qwen3-style templates, `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\n` for the XML family (Qwen3.5,
Qwen3-Coder); and after the `</think>` that closes a block the prompt opened (Qwen3.5's generation prompt)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import pytest

from swarmkv.api.chat_request import ChatRequest, parse_chat_request
from swarmkv.api.outputs import StepOutput
from swarmkv.api.tool_parser import ParsedDelta
from swarmkv.server.pipeline.chat_stream import chat_deltas, parse_whole_reply
from swarmkv.server.pipeline.generate import render_for_model
from swarmkv.tokenizer import Tokenizer
from swarmkv.tokenizer.chat import ChatTemplate
from tool_call_helpers import assemble_calls

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "mode": {"type": "integer"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "list_files", "parameters": {"type": "object", "properties": {}}},
    },
]
# A Qwen3.5-style template, abridged: the tools with XML instructions in the system turn, and a generation
# prompt that opens `<think>` (or writes the empty block when thinking is off).
QWEN35_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}"
    "{{- tool | tojson }}{%- endfor %}{{- '\\n</tools>\\n\\nTo call a function reply with:\\n<tool_call>\\n"
    "<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n"
    "</tool_call><|im_end|>\\n' }}{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}"
)
USER = [{"role": "user", "content": "save it"}]


def _request(tool_choice: Any, **fields: Any) -> ChatRequest:
    return parse_chat_request({"messages": USER, "tools": TOOLS, "tool_choice": tool_choice, **fields})


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def test_a_named_call_opens_in_the_xml_form_with_its_first_required_parameter() -> None:
    req = _request(_named("write_file")).for_template(QWEN35_TEMPLATE)
    assert req.tool_format == "xml"
    assert req.forced_prefix() == "<tool_call>\n<function=write_file>\n<parameter=path>\n"
    assert req.forced_stop() == ("</tool_call>",)
    # A function whose schema requires nothing opens at its header alone.
    assert _request(_named("list_files")).for_template(QWEN35_TEMPLATE).forced_prefix() == (
        "<tool_call>\n<function=list_files>\n"
    )


def test_required_opens_the_function_tag_and_the_model_names_it() -> None:
    req = _request("required").for_template(QWEN35_TEMPLATE)
    assert req.forced_prefix() == "<tool_call>\n<function="
    only_one = parse_chat_request({"messages": USER, "tools": TOOLS[:1], "tool_choice": "required"})
    assert (
        only_one.for_template(QWEN35_TEMPLATE)
        .forced_prefix()
        .startswith("<tool_call>\n<function=write_file>")
    )


def test_hermes_templates_keep_the_json_opening(qwen: Tokenizer) -> None:
    req = _request(_named("write_file")).for_template(qwen.chat_template)
    assert req.tool_format == "hermes"
    assert req.forced_prefix() == '<tool_call>\n{"name": "write_file", "arguments": {"path": "'
    assert _request("auto").for_template(QWEN35_TEMPLATE).forced_prefix() == ""


def _outputs(texts: list[str]) -> list[StepOutput]:
    return [
        StepOutput(text, 1, i == len(texts) - 1, "stop" if i == len(texts) - 1 else None, 5, 0, i + 1, 0.0)
        for i, text in enumerate(texts)
    ]


# What an XML model writes after each forced opening, up to the `</tool_call>` stop string (not included).
NAMED_TAIL = "notes.txt\n</parameter>\n<parameter=mode>\n644\n</parameter>\n</function>\n"
REQUIRED_TAIL = "write_file>\n<parameter=path>\nnotes.txt\n</parameter>\n<parameter=mode>\n644\n</parameter>\n</function>\n"


@pytest.mark.parametrize(
    ("choice", "tail"), [(_named("write_file"), NAMED_TAIL), ("required", REQUIRED_TAIL)]
)
def test_the_forced_opening_and_the_models_tail_parse_as_one_call(choice: Any, tail: str) -> None:
    req = _request(choice).for_template(QWEN35_TEMPLATE)
    parsed = parse_whole_reply(req, _outputs([tail]), req.tool_format)
    (call,) = parsed.tool_calls
    assert parsed.content == ""
    assert (call.name, json.loads(call.arguments)) == ("write_file", {"path": "notes.txt", "mode": 644})


class _NoLatency:
    def observe(self, out: StepOutput) -> None:
        pass


async def _stream(outputs: list[StepOutput]) -> Any:
    for out in outputs:
        yield out


@pytest.mark.parametrize(
    ("choice", "tail"), [(_named("write_file"), NAMED_TAIL), ("required", REQUIRED_TAIL)]
)
def test_streamed_pieces_of_a_forced_xml_call_assemble_to_the_whole_parse(choice: Any, tail: str) -> None:
    req = _request(choice).for_template(QWEN35_TEMPLATE)
    pieces = [tail[i : i + 5] for i in range(0, len(tail), 5)]

    async def run() -> list[ParsedDelta]:
        latency: Any = _NoLatency()
        deltas = chat_deltas(req, _stream(_outputs(pieces)), latency, req.tool_format)  # type: ignore[arg-type]
        return [parsed async for _, parsed in deltas]

    deltas = asyncio.run(run())
    merged = ParsedDelta()
    for delta in deltas:
        merged = merged.then(delta)
    whole = parse_whole_reply(req, _outputs([tail]), req.tool_format)
    assert [c.name for c in merged.tool_calls] == ["write_file"] and merged.content == ""
    ((_, name, arguments),) = assemble_calls(merged.pieces)
    assert name == "write_file" and json.loads(arguments) == json.loads(whole.tool_calls[0].arguments)
    if choice != "required":  # a named call opens with the forced prefix, before the model writes a token
        assert deltas[0].pieces[0].name == "write_file"


def _context(tokenizer: Tokenizer) -> Any:
    return SimpleNamespace(tokenizer=tokenizer, prompt_layout="template")


def test_a_forced_call_closes_the_think_block_the_generation_prompt_opened(qwen: Tokenizer) -> None:
    tokenizer = dataclasses.replace(qwen, template=ChatTemplate(QWEN35_TEMPLATE))
    req, rendered = render_for_model(_context(tokenizer), _request(_named("write_file")), "chat")
    assert req.tool_format == "xml" and req.closes_thinking
    assert rendered.text.endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=write_file>\n<parameter=path>\n"
    )
    # The parser reads the call's opening alone, never the `</think>` before it.
    assert req.forced_call_opening() == "<tool_call>\n<function=write_file>\n<parameter=path>\n"
    assert parse_whole_reply(req, _outputs([NAMED_TAIL]), req.tool_format).tool_calls[0].name == "write_file"
    # With thinking off the template writes the empty block itself: nothing is closed twice.
    off, rendered = render_for_model(
        _context(tokenizer), _request(_named("write_file"), enable_thinking=False), "chat"
    )
    assert not off.closes_thinking
    assert rendered.text.endswith(
        "<think>\n\n</think>\n\n<tool_call>\n<function=write_file>\n<parameter=path>\n"
    )
    # Unforced, the prompt stays open for the model's reasoning.
    auto, rendered = render_for_model(_context(tokenizer), _request("auto"), "chat")
    assert not auto.closes_thinking and rendered.text.endswith("<|im_start|>assistant\n<think>\n")


def test_qwen3_forced_prompts_are_unchanged(qwen: Tokenizer) -> None:
    req, rendered = render_for_model(_context(qwen), _request(_named("write_file")), "chat")
    assert not req.closes_thinking
    assert rendered.text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "write_file", "arguments": {"path": "'
    )
