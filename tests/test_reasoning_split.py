"""`<think>` reasoning split from a chat reply's content: whole and streamed, and when it applies."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from swarmkv.api.chat_request import parse_chat_request
from swarmkv.api.outputs import StepOutput
from swarmkv.api.reasoning import (
    ReasoningSplit,
    ReasoningSplitter,
    is_thinking_template,
    prompt_opens_thinking,
    reasoning_splitter,
)
from swarmkv.api.tool_parser import ParsedDelta
from swarmkv.server.observability.latency import Latency
from swarmkv.server.observability.metrics import ServerMetrics
from swarmkv.server.pipeline.chat_stream import chat_deltas, parse_whole_reply
from swarmkv.tokenizer import Tokenizer

QWEN35_GENERATION_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}
]


def _split(text: str, opened: bool = False) -> ReasoningSplit:
    splitter = ReasoningSplitter(opened)
    return splitter.feed(text).then(splitter.finish())


def _split_pieces(pieces: list[str], opened: bool = False) -> ReasoningSplit:
    splitter = ReasoningSplitter(opened)
    out = ReasoningSplit()
    for piece in pieces:
        out = out.then(splitter.feed(piece))
    return out.then(splitter.finish())


def test_a_leading_think_block_is_the_reasoning() -> None:
    assert _split("<think>\nFirst, 2 + 2.\nSo 4.\n</think>\n\nIt is 4.") == ReasoningSplit(
        "First, 2 + 2.\nSo 4.", "It is 4."
    )
    assert _split("\n<think>x</think>y") == ReasoningSplit("x", "y")


def test_a_prompt_that_opened_the_block_starts_the_reply_as_reasoning() -> None:
    assert _split("Let me see.\n</think>\n\nYes.", opened=True) == ReasoningSplit("Let me see.", "Yes.")
    # Cut off by its length before `</think>`: all of it is reasoning.
    assert _split("Still thinking\n", opened=True) == ReasoningSplit("Still thinking", "")


def test_replies_without_a_leading_block_are_all_content() -> None:
    for text in ("Plain answer.", "Answer, then <think>late</think> text", "  \n", "<thin", "a </think> b"):
        assert _split(text) == ReasoningSplit("", text)


def test_an_empty_block_leaves_no_reasoning() -> None:
    # What Qwen3 writes with thinking switched off, if the prompt has not written it already.
    assert _split("<think>\n\n</think>\n\nHello") == ReasoningSplit("", "Hello")


REPLIES = [
    ("<think>\nplan a\n\nplan b\n</think>\n\nDone.\n", False),
    ("plan\n</think>\n\n<tool_call>\n{}\n</tool_call>", True),
    ("no reasoning <think> here </think>", False),
    ("<think>never closed", False),
]


@settings(max_examples=200, deadline=None)
@given(reply=st.sampled_from(REPLIES), cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=12))
def test_streamed_pieces_split_exactly_like_the_whole_reply(reply: tuple[str, bool], cuts: list[int]) -> None:
    text, opened = reply
    points = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]
    assert _split_pieces(pieces, opened) == _split(text, opened)


def test_a_partial_tag_is_held_back_while_streaming() -> None:
    splitter = ReasoningSplitter()
    assert splitter.feed("<thi") == ReasoningSplit()
    assert splitter.feed("nk>\nidea\n</th") == ReasoningSplit("idea", "")
    assert splitter.feed("ink>\n\nOK") == ReasoningSplit("", "OK")


def test_only_thinking_templates_split(qwen: Tokenizer, smol: Tokenizer) -> None:
    assert is_thinking_template(qwen.chat_template)
    assert not is_thinking_template(smol.chat_template) and not is_thinking_template(None)
    assert reasoning_splitter(smol.chat_template, "x") is None
    messages = [{"role": "user", "content": "hi"}]
    # Qwen3 lets the model open the block; with thinking off, the prompt holds an empty, closed one.
    for enable_thinking in (True, False):
        prompt = qwen.apply_chat_template(messages, enable_thinking=enable_thinking)
        assert not prompt_opens_thinking(prompt)
    assert prompt_opens_thinking(QWEN35_GENERATION_PROMPT)


def test_a_whole_reply_splits_before_its_tool_calls_are_parsed() -> None:
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS})
    text = (
        '<think>\nMaybe <tool_call>{"name": "read_file", "arguments": {}}</tool_call>? No.\n</think>\n\n'
        'Reading.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a"}}\n</tool_call>'
    )
    outputs = [StepOutput(text, 9, True, "stop", 5, 0, 9, 0.0)]
    parsed = parse_whole_reply(req, outputs, "hermes", ReasoningSplitter())
    assert parsed.reasoning.startswith("Maybe <tool_call>") and parsed.reasoning.endswith("? No.")
    assert parsed.content == "Reading."
    assert [c.arguments for c in parsed.tool_calls] == ['{"path": "a"}']
    plain = parse_whole_reply(req, outputs, "hermes")  # no splitter: Messages and Responses as before
    assert plain.reasoning == "" and plain.content.startswith("<think>")


class _NoLatency:
    def observe(self, out: StepOutput) -> None:
        pass


async def _outputs(texts: list[str]) -> AsyncIterator[StepOutput]:
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        yield StepOutput(text, 1, last, "stop" if last else None, 5, 0, i + 1, 0.0)


def test_streamed_deltas_carry_the_reasoning_before_the_content() -> None:
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}]})
    texts = ["Let me", " think.\n</th", "ink>\n\nHel", "lo."]

    async def run() -> list[ParsedDelta]:
        stream: Any = _outputs(texts)
        latency: Any = _NoLatency()
        return [p async for _, p in chat_deltas(req, stream, latency, "hermes", ReasoningSplitter(True))]

    deltas = asyncio.run(run())
    assert [(d.reasoning, d.content) for d in deltas] == [
        ("Let me", ""),
        (" think.", ""),
        ("", "Hel"),
        ("", "lo."),
    ]


def test_a_piece_of_several_tokens_counts_reasoning_tokens_up_to_the_closing_tag() -> None:
    """A draft's or a forced run's output carries several tokens, and its text may close the block: only the
    tokens up to the one holding `</think>`'s end are reasoning."""
    text = "<think>abc</think>\n\nhello"
    whole = ReasoningSplitter()
    whole.feed(text, 5, (7, 10, 18, 20, 25))  # <think> | abc | </think> | \n\n | hello
    assert whole.num_tokens == 3
    pieces = ReasoningSplitter()
    pieces.feed("<think>ab", 2, (7, 9))
    pieces.feed("c</thi", 2, (10, 15))  # the tag is held back, unfinished
    pieces.feed("nk>hi", 2, (18, 20))  # it ends inside the piece's first token
    assert pieces.num_tokens == 5
    unknown = ReasoningSplitter()
    unknown.feed(text, 5)  # without the tokens' ends the piece counts whole, as before
    assert unknown.num_tokens == 5


def test_tokens_that_arrive_together_each_get_an_inter_token_latency() -> None:
    metrics = ServerMetrics.__new__(ServerMetrics)  # its two histograms alone, without an engine to collect
    registry = CollectorRegistry()
    metrics.time_to_first_token = Histogram("ttft", "t", registry=registry)
    metrics.inter_token_latency = Histogram("itl", "t", registry=registry)
    latency = Latency(metrics, arrival_s=0.0)
    for at_s, num_tokens in ((1.0, 1), (2.0, 3), (2.5, 2)):
        latency.observe(StepOutput("x", num_tokens, False, None, 4, 0, 6, at_s))
    assert registry.get_sample_value("ttft_count") == 1
    assert registry.get_sample_value("itl_count") == 5  # one a token after the first
    assert registry.get_sample_value("itl_sum") == 1.0 + 0.5  # the tokens after an output's first: 0
