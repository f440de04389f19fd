"""The Hermes tool-call parser: whole replies, streamed pieces, and what stays content."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from swarmkv.api.tool_call_stream import CallPiece
from swarmkv.api.tool_parser import ParsedDelta, StreamingToolParser, ToolCall, parse_tool_calls
from tool_call_helpers import assemble_calls


def _ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _parse(text: str) -> ParsedDelta:
    return parse_tool_calls(text, new_id=_ids())


def _stream(pieces: list[str]) -> tuple[str, list[ToolCall]]:
    content, calls, _ = _stream_with_pieces(pieces)
    return content, calls


def _stream_with_pieces(pieces: list[str]) -> tuple[str, list[ToolCall], list[CallPiece]]:
    parser = StreamingToolParser(new_id=_ids())
    out = ParsedDelta()
    for piece in pieces:
        out = out.then(parser.feed(piece))
    out = out.then(parser.finish())
    return out.content, out.tool_calls, out.pieces


def test_one_call_becomes_a_tool_call_without_content() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = _parse(text)
    assert parsed.content == ""
    assert [(c.id, c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("call_0", "get_weather", {"city": "Paris"})
    ]


def test_text_around_calls_is_content_and_parallel_calls_keep_their_order() -> None:
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
        '{"name": "b", "arguments": {}}\n</tool_call>\nDone.'
    )
    parsed = _parse(text)
    assert parsed.content == "Let me check.\nDone."
    assert [c.name for c in parsed.tool_calls] == ["a", "b"]
    assert [c.arguments for c in parsed.tool_calls] == ['{"x": 1}', "{}"]


def test_a_block_that_is_not_a_call_stays_content_verbatim() -> None:
    for body in ("not json", '{"arguments": {}}', '["a"]', '{"name": "", "arguments": {}}'):
        text = f"before <tool_call>{body}</tool_call> after"
        parsed = _parse(text)
        assert parsed.tool_calls == []
        assert parsed.content == text


def test_missing_outer_brace_is_supplied() -> None:
    # What SmolLM2-135M writes after a forced call prefix: the arguments object closed, the call not.
    text = '<tool_call>\n{"name": "f", "arguments": \n{"city": "Paris"}\n</tool_call>'
    (call,) = _parse(text).tool_calls
    assert call.name == "f" and json.loads(call.arguments) == {"city": "Paris"}


def test_unterminated_block_parses_at_the_end_and_keeps_trailing_text() -> None:
    parsed = _parse('<tool_call>\n{"name": "f", "arguments": {"n": 2}} and then')
    assert [c.name for c in parsed.tool_calls] == ["f"]
    assert parsed.content == " and then"
    cut = _parse('<tool_call>\n{"name": "f", "argum')
    assert cut.tool_calls == [] and cut.content == '<tool_call>\n{"name": "f", "argum'


def test_string_arguments_are_kept_when_they_are_json() -> None:
    (call,) = _parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>').tool_calls
    assert json.loads(call.arguments) == {"a": 1}
    assert _parse('<tool_call>{"name": "f", "arguments": "oops"}</tool_call>').tool_calls == []


def test_plain_text_and_lookalike_tags_are_untouched() -> None:
    assert _parse("a < b and <tool> or <tool_cal").content == "a < b and <tool> or <tool_cal"
    assert _parse("  \n").content == "  \n"


def test_streaming_holds_back_a_partial_tag() -> None:
    parser = StreamingToolParser()
    assert parser.feed("Hi <tool_").content == "Hi"  # the space waits for what follows
    assert parser.feed("ca").content == ""
    out = parser.feed('ll>{"name": "f", "arguments": {}}</tool_call>')
    assert out.content == "" and [c.name for c in out.tool_calls] == ["f"]


REPLIES = [
    "plain text with no calls at all",
    'Sure.\n<tool_call>\n{"name": "a", "arguments": {"q": "x<y"}}\n</tool_call>\n',
    '<tool_call>{"name": "a", "arguments": {}}</tool_call>\n\n<tool_call>{"name": "b", "arguments": {"k": [1, 2]}}</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": \n{"city": "Paris"}\n</tool_call>\n\nThe weather is nice.',
    "<tool_call>broken</tool_call> tail <tool_call>",
    '<tool_call>\n{"name": "f", "arguments": {"n": 1}}',
]


@settings(max_examples=200, deadline=None)
@given(reply=st.sampled_from(REPLIES), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_streamed_pieces_parse_exactly_like_the_whole_reply(reply: str, cuts: list[int]) -> None:
    points = sorted({c % (len(reply) + 1) for c in cuts})
    pieces = [reply[a:b] for a, b in zip([0, *points], [*points, len(reply)], strict=True)]
    whole = _parse(reply)
    content, calls = _stream(pieces)
    assert content == whole.content
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        (c.id, c.name, c.arguments) for c in whole.tool_calls
    ]


FRAGMENTS = [
    "<tool_call>",
    "</tool_call>",
    '{"name": "f", "arguments": {"a": 1}}',
    '{"name": "g", "arguments": ',
    "}",
    "{",
    " ",
    "\n",
    "<",
    "tool_",
    "call>",
    "word",
]


@settings(max_examples=300, deadline=None)
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=14),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=10),
)
def test_any_reply_streams_like_it_parses_whole(parts: list[str], cuts: list[int]) -> None:
    reply = "".join(parts)
    points = sorted({c % (len(reply) + 1) for c in cuts})
    pieces = [reply[a:b] for a, b in zip([0, *points], [*points, len(reply)], strict=True)]
    whole = _parse(reply)
    content, calls = _stream(pieces)
    assert (content, calls) == (whole.content, whole.tool_calls)
    if not whole.tool_calls:
        assert content == reply  # without calls, nothing the model wrote is lost
    _, _, pieces = _stream_with_pieces(pieces)
    assert [(i, n) for i, n, _ in assemble_calls(pieces)] == [(c.id, c.name) for c in calls]
    for (_, _, streamed), call in zip(assemble_calls(pieces), calls, strict=True):
        if _is_json(call.arguments):
            assert json.loads(streamed) == json.loads(call.arguments)
        else:
            assert streamed == call.arguments


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_arguments_stream_before_the_block_closes() -> None:
    parser = StreamingToolParser(new_id=_ids())
    opened = parser.feed('Sure.<tool_call>\n{"name": "grep", "arguments": {"pattern": "def ma')
    assert opened.tool_calls == []
    assert [(p.id, p.name) for p in opened.pieces] == [("call_0", "grep"), ("call_0", None)]
    assert "".join(p.arguments for p in opened.pieces) == '{"pattern": "def ma'
    more = parser.feed('in", "path": "src/</')  # "</" may open the closing tag: held back
    assert "".join(p.arguments for p in more.pieces) == 'in", "path": "src/'
    end = parser.feed('x"}}\n</tool_call>')
    assert "".join(p.arguments for p in end.pieces) == '</x"}'  # not the call's own closing brace
    (call,) = end.tool_calls
    assert json.loads(call.arguments) == {"pattern": "def main", "path": "src/</x"}


def test_a_forgotten_closing_brace_comes_as_the_last_piece() -> None:
    _, calls, pieces = _stream_with_pieces(
        ['<tool_call>{"name": "f", "arguments": {"a": {"b": 1}', "</tool_call>"]
    )
    ((_, _, streamed),) = assemble_calls(pieces)
    assert json.loads(streamed) == json.loads(calls[0].arguments) == {"a": {"b": 1}}


def test_a_call_whose_arguments_never_parse_keeps_them_raw() -> None:
    parsed = _parse('<tool_call>{"name": "f", "arguments": {"a": nope}</tool_call> after')
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("f", '{"a": nope}')]
    assert parsed.content == " after"
