"""A thinking model's reasoning in each API's own field, without a model: the template's switches
(`chat_template_kwargs`, `enable_thinking`, Messages' `thinking`, Responses' `reasoning.effort`), past reasoning
sent back (chat `reasoning_content`, Messages thinking blocks, Responses reasoning items), and the answer objects
and stream events (Messages thinking blocks, Responses reasoning items) as Claude Code and Codex CLI parse them."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from swarmkv.api.chat_request import parse_chat_request
from swarmkv.api.errors import APIError
from swarmkv.api.messages_objects import ContentBlocks, reply_content, thinking_signature
from swarmkv.api.messages_request import parse_messages_request
from swarmkv.api.reasoning import ReasoningSplitter, reasoning_splitter
from swarmkv.api.responses_objects import EventWriter, reasoning_item
from swarmkv.api.responses_request import parse_responses_request
from swarmkv.api.responses_stream import OutputItems
from swarmkv.api.tool_call_stream import CallPiece
from swarmkv.api.tool_parser import ParsedDelta, ToolCall
from swarmkv.server.pipeline.generate import render_for_model
from swarmkv.tokenizer import Tokenizer

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
EMPTY_THINK = "<think>\n\n</think>\n\n"  # what Qwen3's template writes when thinking is off


def _context(tokenizer: Tokenizer) -> Any:
    return SimpleNamespace(tokenizer=tokenizer, prompt_layout="template")


# --- the template's switches -------------------------------------------------------------------------


def test_chat_template_kwargs_and_enable_thinking_reach_the_template(qwen: Tokenizer) -> None:
    on = parse_chat_request({"messages": USER})
    assert on.template_kwargs == {} and on.thinking_enabled
    for fields in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"enable_thinking": False},
        {"enable_thinking": False, "chat_template_kwargs": {"enable_thinking": False}},
    ):
        off = parse_chat_request({"messages": USER, **fields})
        assert off.template_kwargs == {"enable_thinking": False} and not off.thinking_enabled
        _, rendered = render_for_model(_context(qwen), off, "chat")
        assert rendered.text.endswith("<|im_start|>assistant\n" + EMPTY_THINK)
    _, rendered = render_for_model(_context(qwen), on, "chat")
    assert rendered.text.endswith("<|im_start|>assistant\n")
    # Any other switch is the template's to read.
    assert parse_chat_request({"messages": USER, "chat_template_kwargs": {"x": 1}}).template_kwargs == {
        "x": 1
    }


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        (
            {"chat_template_kwargs": {"add_generation_prompt": False}},
            "chat_template_kwargs.add_generation_prompt",
        ),
        ({"enable_thinking": "no"}, "enable_thinking"),
        ({"enable_thinking": True, "chat_template_kwargs": {"enable_thinking": False}}, "enable_thinking"),
    ],
)
def test_bad_template_switches_are_400s_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as caught:
        parse_chat_request({"messages": USER, **fields})
    assert caught.value.status == 400 and caught.value.param == param


def test_responses_pass_the_switches_and_effort_none_switches_thinking_off() -> None:
    def kwargs(**fields: Any) -> dict[str, Any]:
        return parse_responses_request({"input": "hi", **fields}, []).chat.template_kwargs

    assert kwargs() == {} and kwargs(reasoning={"effort": "high", "summary": "auto"}) == {}
    assert kwargs(chat_template_kwargs={"enable_thinking": False}) == {"enable_thinking": False}
    assert kwargs(enable_thinking=False) == {"enable_thinking": False}
    assert kwargs(reasoning={"effort": "none"}) == {"enable_thinking": False}
    # The client's own switch wins over the effort.
    assert kwargs(reasoning={"effort": "none"}, enable_thinking=True) == {"enable_thinking": True}
    assert kwargs(reasoning={"effort": "none"}, chat_template_kwargs={"enable_thinking": True}) == {
        "enable_thinking": True
    }
    with pytest.raises(APIError):
        parse_responses_request({"input": "hi", "reasoning": {"summary": "verbose"}}, [])


def test_messages_thinking_is_the_switch_on_the_chat_request() -> None:
    def chat_kwargs(thinking: Any) -> dict[str, Any]:
        body = {"max_tokens": 64, "messages": USER, "thinking": thinking}
        return parse_messages_request(body).chat.template_kwargs

    assert chat_kwargs({"type": "adaptive", "display": "updates"}) == {"enable_thinking": True}
    assert chat_kwargs({"type": "disabled"}) == {"enable_thinking": False}


def test_the_splitter_counts_the_reasoning_blocks_tokens_tags_included() -> None:
    splitter = ReasoningSplitter()
    for text in ("<thi", "nk>", "\nPlan", ".\n", "</think>", "\n\n", "Done", "."):
        splitter.feed(text, 1)
    splitter.finish()
    assert splitter.num_tokens == 5  # `<thi`, `nk>`, the two of the plan and `</think>`
    opened = ReasoningSplitter(opened=True)
    for text in ("Plan", "</think>\n\nDone"):
        opened.feed(text, 2)
    assert opened.num_tokens == 4
    plain = ReasoningSplitter()
    for text in ("<", "b>bold</b>"):
        plain.feed(text, 1)
    assert plain.num_tokens == 0


def test_a_switched_off_or_plain_template_splits_nothing(qwen: Tokenizer, smol: Tokenizer) -> None:
    assert reasoning_splitter(qwen.chat_template, "x", enabled=False) is None
    assert reasoning_splitter(smol.chat_template, "x", enabled=True) is None
    assert reasoning_splitter(qwen.chat_template, "x") is not None


# --- past reasoning sent back ---------------------------------------------------------------------------

CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


def test_chat_history_reasoning_renders_in_the_tool_loop_and_drops_after_a_new_query(qwen: Tokenizer) -> None:
    for key in ("reasoning_content", "reasoning"):  # this server's name and vLLM's newer one
        turn = {"role": "assistant", "content": None, key: "Check the weather.", "tool_calls": [CALL]}
        req = parse_chat_request({"messages": [*USER, turn, TOOL_RESULT], "tools": TOOLS})
        assert req.messages[1]["reasoning_content"] == "Check the weather."
        _, rendered = render_for_model(_context(qwen), req, "chat")
        assert "<|im_start|>assistant\n<think>\nCheck the weather.\n</think>\n\n<tool_call>" in rendered.text
    later = [
        *USER,
        turn,
        TOOL_RESULT,
        {"role": "assistant", "content": "Sunny."},
        {"role": "user", "content": "Thanks"},
    ]
    _, rendered = render_for_model(
        _context(qwen), parse_chat_request({"messages": later, "tools": TOOLS}), "chat"
    )
    assert "Check the weather." not in rendered.text  # Qwen3's template drops past thinking
    with pytest.raises(APIError):
        parse_chat_request({"messages": [*USER, {"role": "assistant", "reasoning_content": 3}]})
    # A turn cut off while reasoning has no content but is still a turn.
    cut = parse_chat_request({"messages": [*USER, {"role": "assistant", "reasoning_content": "Hmm"}]})
    assert cut.messages[1] == {"role": "assistant", "content": "", "reasoning_content": "Hmm"}


def test_messages_thinking_blocks_in_history_become_the_turns_reasoning() -> None:
    assistant = {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "Check the weather.", "signature": thinking_signature("x")},
            {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
        ],
    }
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}],
    }
    body = {"max_tokens": 64, "messages": [*USER, assistant, result]}
    turn = parse_messages_request(body).chat.messages[1]
    assert turn["reasoning_content"] == "Check the weather." and turn["content"] == "Checking."
    assert [c["function"]["name"] for c in turn["tool_calls"]] == ["get_weather"]
    thinking_only = {
        "role": "assistant",
        "content": [{"type": "thinking", "thinking": "Hmm", "signature": ""}],
    }
    body = {"max_tokens": 64, "messages": [*USER, thinking_only, {"role": "user", "content": "go on"}]}
    assert parse_messages_request(body).chat.messages[1]["reasoning_content"] == "Hmm"
    with pytest.raises(APIError):  # only an assistant turn thinks
        parse_messages_request(
            {"max_tokens": 64, "messages": [{"role": "user", "content": thinking_only["content"]}]}
        )


def test_responses_reasoning_items_become_the_next_assistant_turns_reasoning() -> None:
    def turn(reasoning: dict[str, Any]) -> dict[str, Any]:
        items = [
            {"type": "message", "role": "user", "content": "weather?"},
            {"type": "reasoning", "id": "rs_1", **reasoning},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ]
        messages = parse_responses_request({"input": items}, []).chat.messages
        assert [m["role"] for m in messages] == ["user", "assistant", "tool"]
        return messages[1]

    # As Codex CLI sends it back: the summary, the reasoning_text content, no encrypted content.
    codex = {
        "summary": [{"type": "summary_text", "text": "Short."}],
        "content": [{"type": "reasoning_text", "text": "Check the weather."}],
        "encrypted_content": None,
    }
    assert turn(codex)["reasoning_content"] == "Check the weather."
    assert len(turn(codex)["tool_calls"]) == 1
    assert turn({"summary": [{"type": "summary_text", "text": "Short."}]})["reasoning_content"] == "Short."
    # Only OpenAI can read encrypted reasoning: the turn is rendered without it.
    assert "reasoning_content" not in turn({"summary": [], "encrypted_content": "gAAAA"})
    with pytest.raises(APIError):
        turn({"summary": [{"type": "output_text", "text": "x"}]})
    # A reasoning item followed by a message item: one assistant turn.
    items = [
        {"type": "message", "role": "user", "content": "hi"},
        reasoning_item("rs_2", "Greet back.", summary=True),
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"type": "message", "role": "user", "content": "bye"},
    ]
    messages = parse_responses_request({"input": items}, []).chat.messages
    assert messages[1] == {"role": "assistant", "content": "Hello.", "reasoning_content": "Greet back."}


# --- answer objects and stream events -----------------------------------------------------------------

REASONING = ParsedDelta(reasoning="Check")
CALL_PIECES = [CallPiece(0, "call_1", "get_weather", ""), CallPiece(0, "call_1", None, '{"city": "Paris"}')]


def _anthropic(event: str) -> dict[str, Any]:
    kind, data = event.strip().split("\n")
    payload: dict[str, Any] = json.loads(data.removeprefix("data: "))
    assert kind == f"event: {payload['type']}"
    return payload


def test_messages_whole_reply_opens_with_its_signed_thinking_block() -> None:
    parsed = ParsedDelta("Checking.", [ToolCall("toolu_1", "get_weather", '{"city": "Paris"}')], [], "Hmm.")
    content = reply_content(parsed)
    assert [block["type"] for block in content] == ["thinking", "text", "tool_use"]
    assert content[0] == {"type": "thinking", "thinking": "Hmm.", "signature": thinking_signature("Hmm.")}
    assert content[0]["signature"] and thinking_signature("a") != thinking_signature("b")
    assert reply_content(ParsedDelta("Hi.")) == [{"type": "text", "text": "Hi."}]


def test_messages_stream_a_thinking_block_as_anthropic_does() -> None:
    blocks = ContentBlocks()
    deltas = [
        REASONING,
        ParsedDelta(reasoning=" the weather."),
        ParsedDelta(content="Checking.", pieces=CALL_PIECES),
        ParsedDelta(tool_calls=[ToolCall("call_1", "get_weather", '{"city": "Paris"}')]),
    ]
    events = [_anthropic(e) for d in deltas for e in blocks.add(d)] + [_anthropic(e) for e in blocks.close()]
    shapes = [
        (e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {}).get("type"))
        for e in events
    ]
    assert shapes == [
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
    ]
    assert events[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert "".join(e["delta"].get("thinking", "") for e in events[1:3]) == "Check the weather."
    assert events[3]["delta"]["signature"] == thinking_signature("Check the weather.")
    # A reply cut off while thinking still ends its block, signed.
    cut = ContentBlocks()
    events = [_anthropic(e) for e in [*cut.add(REASONING), *cut.close()]]
    assert [e["type"] for e in events] == ["content_block_start", "content_block_delta"] + [
        "content_block_delta",
        "content_block_stop",
    ]


def _responses(events: list[str]) -> list[dict[str, Any]]:
    return [_anthropic(e) for e in events]  # the same `event:` + `data:` framing


@pytest.mark.parametrize("summary", [False, True])
def test_responses_stream_a_reasoning_item_as_codex_parses_it(summary: bool) -> None:
    items = OutputItems(EventWriter(), summary=summary)
    deltas = [REASONING, ParsedDelta(reasoning=" the weather."), ParsedDelta(content="Sunny.")]
    events = _responses([e for d in deltas for e in items.add(d)] + list(items.close()))
    kinds = [e["type"] for e in events]
    reasoning_kinds = (
        ["response.output_item.added", "response.content_part.added"]
        + ["response.reasoning_summary_part.added"] * summary
        + (["response.reasoning_text.delta"] + ["response.reasoning_summary_text.delta"] * summary) * 2
        + ["response.reasoning_text.done", "response.content_part.done"]
        + ["response.reasoning_summary_text.done", "response.reasoning_summary_part.done"] * summary
        + ["response.output_item.done"]
    )
    assert kinds[: len(reasoning_kinds)] == reasoning_kinds
    assert kinds[len(reasoning_kinds)] == "response.output_item.added"  # the message, at output_index 1
    assert events[len(reasoning_kinds)]["output_index"] == 1
    # Codex reads `delta` with `content_index` (raw reasoning) and with `summary_index` (the summary).
    text_deltas = [e for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(e["delta"] for e in text_deltas) == "Check the weather."
    assert all(e["content_index"] == 0 and e["output_index"] == 0 for e in text_deltas)
    summary_deltas = [e for e in events if e["type"] == "response.reasoning_summary_text.delta"]
    assert len(summary_deltas) == (2 if summary else 0) and all(
        e["summary_index"] == 0 for e in summary_deltas
    )
    done = next(e for e in events if e["type"] == "response.output_item.done")["item"]
    assert done["type"] == "reasoning" and done["id"].startswith("rs_") and done["status"] == "completed"
    assert done["content"] == [{"type": "reasoning_text", "text": "Check the weather."}]
    assert done["summary"] == ([{"type": "summary_text", "text": "Check the weather."}] if summary else [])
    assert done["encrypted_content"] is None
    assert [item["type"] for item in items.output] == ["reasoning", "message"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
