"""The XML tool-call format (Qwen3.5, Qwen3-Coder): whole and streamed parses, typed values, the format's choice."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from swarmkv.api.chat_request import parse_chat_request
from swarmkv.api.outputs import StepOutput
from swarmkv.api.tool_formats import tool_format_of, typed_value
from swarmkv.api.tool_parser import ParsedDelta, StreamingToolParser, ToolCall, parse_tool_calls
from swarmkv.server.pipeline.chat_stream import parse_whole_reply
from swarmkv.tokenizer import Tokenizer
from tool_call_helpers import assemble_calls

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "mode": {"type": "integer"},
                    "ratio": {"type": "number"},
                    "force": {"type": "boolean"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "meta": {"type": "object"},
                    "limit": {"type": ["integer", "null"]},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    },
]

ONE_CALL = (
    "I will write the file.\n\n<tool_call>\n<function=write_file>\n"
    "<parameter=path>\nsrc/main.py\n</parameter>\n"
    "<parameter=content>\ndef main():\n    return 1 < 2\n\n</parameter>\n"
    "<parameter=mode>\n644\n</parameter>\n"
    "<parameter=ratio>\n0.5\n</parameter>\n"
    "<parameter=force>\nTrue\n</parameter>\n"
    '<parameter=tags>\n["a", "b"]\n</parameter>\n'
    '<parameter=meta>\n{"k": {"n": 1}}\n</parameter>\n'
    "<parameter=limit>\nnull\n</parameter>\n"
    "</function>\n</tool_call>"
)
ONE_CALL_ARGUMENTS = {
    "path": "src/main.py",
    "content": "def main():\n    return 1 < 2\n",
    "mode": 644,
    "ratio": 0.5,
    "force": True,
    "tags": ["a", "b"],
    "meta": {"k": {"n": 1}},
    "limit": None,
}
TWO_CALLS = (
    "<tool_call>\n<function=read_file>\n<parameter=path>\na.txt\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=read_file>\n<parameter=path>\nb.txt\n</parameter>\n</function>\n</tool_call>"
)

# The tool instructions of Qwen3.5's chat template (abridged), and of Qwen3's.
QWEN35_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n"
    "<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools>' }}"
    "{{- '\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n"
    "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n"
    "</parameter>\\n</function>\\n</tool_call>' }}{%- endif %}"
)
QWEN3_TEMPLATE = (
    "{{- '\\n\\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
)


def _ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _parse(text: str, tools: list[dict[str, Any]] | None = TOOLS) -> ParsedDelta:
    return parse_tool_calls(text, new_id=_ids(), fmt="xml", tools=tools)


def _stream(pieces: list[str], tools: list[dict[str, Any]] | None = TOOLS) -> ParsedDelta:
    parser = StreamingToolParser(new_id=_ids(), fmt="xml", tools=tools)
    out = ParsedDelta()
    for piece in pieces:
        out = out.then(parser.feed(piece))
    return out.then(parser.finish())


def _triples(calls: list[ToolCall]) -> list[tuple[str, str, str]]:
    return [(c.id, c.name, c.arguments) for c in calls]


def test_a_call_with_several_typed_and_multiline_parameters() -> None:
    parsed = _parse(ONE_CALL)
    assert parsed.content == "I will write the file."
    (call,) = parsed.tool_calls
    assert call.name == "write_file"
    assert json.loads(call.arguments) == ONE_CALL_ARGUMENTS
    assert list(json.loads(call.arguments)) == list(ONE_CALL_ARGUMENTS)  # the order the model wrote


def test_two_calls_in_one_reply_keep_their_order() -> None:
    parsed = _parse(TWO_CALLS)
    assert parsed.content == ""
    assert _triples(parsed.tool_calls) == [
        ("call_0", "read_file", '{"path": "a.txt"}'),
        ("call_1", "read_file", '{"path": "b.txt"}'),
    ]


def test_values_stay_text_without_a_schema_type() -> None:
    text = "<tool_call>\n<function=other>\n<parameter=n>\n42\n</parameter>\n</function>\n</tool_call>"
    for tools in (None, TOOLS):  # no tools given, or a function the tools do not describe
        (call,) = _parse(text, tools).tool_calls
        assert json.loads(call.arguments) == {"n": "42"}


def test_values_that_do_not_fit_their_type_stay_text() -> None:
    assert typed_value("many", {"type": "integer"}) == "many"
    assert typed_value("yes", {"type": "boolean"}) == "yes"
    assert typed_value("{oops", {"type": "object"}) == "{oops"
    assert typed_value("3", {"type": "number"}) == 3
    assert typed_value("1e3", {"type": "number"}) == 1000.0
    assert typed_value("null", {"type": "string"}) == "null"
    assert typed_value(" 7 ", {"type": ["null", "integer"]}) == 7


def test_a_missing_closing_tag_ends_at_the_next_parameter_or_the_function() -> None:
    text = (
        "<tool_call>\n<function=write_file>\n<parameter=path>\nx.py\n"
        "<parameter=mode>\n7\n</function>\n</tool_call>"
    )
    (call,) = _parse(text).tool_calls
    assert json.loads(call.arguments) == {"path": "x.py", "mode": 7}


def test_a_call_cut_off_before_its_close_keeps_what_was_written() -> None:
    text = "<tool_call>\n<function=write_file>\n<parameter=path>\nx.py\n</parameter>\n<parameter=mode>\n7"
    (call,) = _parse(text).tool_calls
    assert json.loads(call.arguments) == {"path": "x.py", "mode": 7}
    (empty,) = _parse("<tool_call>\n<function=read_file>\n</function>\n</tool_call>").tool_calls
    assert empty.arguments == "{}"


def test_a_json_body_still_parses_and_a_block_without_a_call_stays_content() -> None:
    # A forced call's opening is written in Hermes form whatever the model family.
    (call,) = _parse(
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>'
    ).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("read_file", {"path": "a"})
    for text in ("x <tool_call>\n<function=>\n</tool_call> y", "<tool_call>no call</tool_call>"):
        parsed = _parse(text)
        assert parsed.tool_calls == [] and parsed.content == text


def test_the_hermes_format_leaves_xml_blocks_as_content() -> None:
    assert parse_tool_calls(TWO_CALLS, fmt="hermes").content == TWO_CALLS


def test_each_parameter_streams_as_it_completes() -> None:
    parser = StreamingToolParser(new_id=_ids(), fmt="xml", tools=TOOLS)
    opened = parser.feed("Text first.\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/ma")
    assert opened.content == "Text first."
    assert [(p.name, p.arguments) for p in opened.pieces] == [("write_file", "")]
    first = parser.feed("in.py\n</parameter>\n<parameter=mode>\n6")
    assert [p.arguments for p in first.pieces] == ['{"path": "src/main.py"']
    second = parser.feed("44\n</parameter>\n</function>")
    assert [p.arguments for p in second.pieces] == [', "mode": 644}']  # one piece per text fed
    assert second.tool_calls == []  # the call is complete once its block closes
    done = parser.feed("\n</tool_call>")
    assert _triples(done.tool_calls) == [("call_0", "write_file", '{"path": "src/main.py", "mode": 644}')]
    assert done.pieces == [] and parser.finish() == ParsedDelta()


REPLIES = [ONE_CALL, TWO_CALLS, ONE_CALL + "\n" + TWO_CALLS + "\nDone.", "no calls <tool_call here"]


@settings(max_examples=150, deadline=None)
@given(reply=st.sampled_from(REPLIES), cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=16))
def test_streamed_pieces_parse_exactly_like_the_whole_reply(reply: str, cuts: list[int]) -> None:
    points = sorted({c % (len(reply) + 1) for c in cuts})
    pieces = [reply[a:b] for a, b in zip([0, *points], [*points, len(reply)], strict=True)]
    whole = _parse(reply)
    streamed = _stream(pieces)
    assert streamed.content == whole.content
    assert _triples(streamed.tool_calls) == _triples(whole.tool_calls)
    assert assemble_calls(streamed.pieces) == _triples(whole.tool_calls)
    for _, _, arguments in assemble_calls(streamed.pieces):
        json.loads(arguments)


def test_character_by_character_stream_matches_the_whole_reply() -> None:
    reply = REPLIES[2]
    streamed = _stream(list(reply))
    assert streamed.content == "I will write the file.\nDone."
    assert assemble_calls(streamed.pieces) == _triples(_parse(reply).tool_calls)


def test_the_format_follows_the_chat_template(qwen: Tokenizer, smol: Tokenizer) -> None:
    assert tool_format_of(QWEN35_TEMPLATE) == "xml"
    assert tool_format_of(QWEN3_TEMPLATE) == "hermes"
    assert tool_format_of(qwen.chat_template) == "hermes"  # Qwen3's own template
    assert tool_format_of(smol.chat_template) == "hermes"
    assert tool_format_of(None) == "hermes"


def test_a_finished_reply_is_parsed_in_the_format_given() -> None:
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    outputs = [
        StepOutput(TWO_CALLS[:40], 10, False, None, 5, 0, 10, 0.0),
        StepOutput(TWO_CALLS[40:], 10, True, "stop", 5, 0, 20, 0.0),
    ]
    assert [c.name for c in parse_whole_reply(req, outputs, "xml").tool_calls] == ["read_file"] * 2
    assert parse_whole_reply(req, outputs, "hermes").content == TWO_CALLS
