"""The prefix-break classifier: each cause from a pair of rendered prompts, at the token where they part."""

from __future__ import annotations

from typing import Any

import pytest

from conftest_tokenizer_helpers import SEARCH_TOOL, WEATHER_TOOL
from swarmkv.breaks.causes import (
    CAUSES,
    MAX_EVIDENCE_CHARS,
    Break,
    RenderedPrompt,
    char_offset,
    classify,
    divergence,
    head_chars,
)
from swarmkv.tokenizer import Tokenizer

COMMON = (
    "Follow the repository's style guide. Keep functions small and typed.\n"
    "Run the tests you touch before you answer, and report the last line of their output.\n"
    "Never invent file names, functions or flags; read the code first.\n"
    "When a tool helps, call it; when it fails, say what failed and what you tried."
)


def render(
    tok: Tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> RenderedPrompt:
    text = tok.apply_chat_template(messages, tools=tools)
    return RenderedPrompt(tok.encode(text), text, messages, tools)


def chat(system: str, *turns: str) -> list[dict[str, Any]]:
    roles = ("user", "assistant")
    return [{"role": "system", "content": system}] + [
        {"role": roles[i % 2], "content": text} for i, text in enumerate(turns)
    ]


def check(tok: Tokenizer, earlier: RenderedPrompt, later: RenderedPrompt, cause: str) -> Break:
    offset = divergence(earlier.token_ids, later.token_ids)
    assert offset < len(earlier.token_ids)
    found = classify(earlier, later, offset, tok)
    assert (found.cause, found.offset) == (cause, offset), found
    assert found.cause in CAUSES
    assert 0 < len(found.text) <= MAX_EVIDENCE_CHARS
    return found


def test_causes_are_the_nine_names_in_order() -> None:
    assert CAUSES == (
        "timestamp",
        "random_id",
        "per_instance_env",
        "tool_order",
        "tool_set",
        "system_edit",
        "history_rewrite",
        "private_before_shared",
        "other",
    )


def test_divergence_is_the_common_prefix_length() -> None:
    assert divergence([], [1]) == 0
    assert divergence([1, 2, 3], [1, 2, 3]) == 3
    assert divergence([1, 2, 3], [1, 2]) == 2
    assert divergence([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert divergence(range(1000), [*range(700), -1]) == 700


def test_timestamp_at_the_top_of_the_system_prompt(smol: Tokenizer) -> None:
    a = render(smol, chat(f"Current time: 2025-03-14 09:26:53\n{COMMON}", "hi"))
    b = render(smol, chat(f"Current time: 2025-03-14 09:27:08\n{COMMON}", "hi"))
    found = check(smol, a, b, "timestamp")
    assert found.text.startswith("2025-03-14 09:27:08")


def test_uuid_nonce(smol: Tokenizer) -> None:
    a = render(smol, chat(f"Request 3f1c2a9e-8b7d-4c6f-9e1a-2b3c4d5e6f70\n{COMMON}", "hi"))
    b = render(smol, chat(f"Request 9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d\n{COMMON}", "hi"))
    assert "9a8b7c6d-5e4f" in check(smol, a, b, "random_id").text


def test_tools_reordered(smol: Tokenizer) -> None:
    a = render(smol, chat(COMMON, "hi"), [WEATHER_TOOL, SEARCH_TOOL])
    b = render(smol, chat(COMMON, "hi"), [SEARCH_TOOL, WEATHER_TOOL])
    check(smol, a, b, "tool_order")


@pytest.mark.parametrize("later_tools", [[WEATHER_TOOL, SEARCH_TOOL], [SEARCH_TOOL]])
def test_tools_added_or_removed(smol: Tokenizer, later_tools: list[dict[str, Any]]) -> None:
    a = render(
        smol, chat(COMMON, "hi"), [WEATHER_TOOL] if len(later_tools) == 2 else [WEATHER_TOOL, SEARCH_TOOL]
    )
    b = render(smol, chat(COMMON, "hi"), later_tools)
    check(smol, a, b, "tool_set")


def test_an_edit_late_in_the_system_prompt(smol: Tokenizer) -> None:
    a = render(smol, chat(COMMON + "\nAnswer in English.", "hi"))
    b = render(smol, chat(COMMON + "\nAnswer in French.", "hi"))
    assert check(smol, a, b, "system_edit").text.startswith("French.")


def test_agent_name_above_the_common_instructions(smol: Tokenizer) -> None:
    a = render(smol, chat(f"You are Ada, the planner.\n{COMMON}", "hi"), [WEATHER_TOOL])
    b = render(smol, chat(f"You are Grace, the reviewer.\n{COMMON}", "hi"), [WEATHER_TOOL])
    assert "Grace" in check(smol, a, b, "private_before_shared").text


def test_an_edited_assistant_turn(smol: Tokenizer) -> None:
    a = render(smol, chat(COMMON, "fix the bug", "I changed foo.py and the tests pass.", "thanks"))
    b = render(smol, chat(COMMON, "fix the bug", "I changed foo.py.", "thanks", "ok", "and now?"))
    check(smol, a, b, "history_rewrite")


def test_reasoning_the_template_strips_from_history(qwen: Tokenizer) -> None:
    turn = {"role": "assistant", "content": "<think>\nThe user wants the weather.\n</think>\n\nLet me look."}
    head = [{"role": "system", "content": COMMON}, {"role": "user", "content": "weather in Paris?"}, turn]
    a = render(qwen, [*head, {"role": "tool", "content": "sunny, 21 C"}], [WEATHER_TOOL])
    b = render(
        qwen,
        [*head, {"role": "tool", "content": "sunny, 21 C"}, {"role": "assistant", "content": "Sunny."}]
        + [{"role": "user", "content": "and Rome?"}],
        [WEATHER_TOOL],
    )
    assert "<think>" in a.text and "<think>" not in b.text
    assert check(qwen, a, b, "history_rewrite").text.startswith("Let me look.")


def test_completion_prompts_are_other(smol: Tokenizer) -> None:
    a = RenderedPrompt(smol.encode("The plan: step one"), "The plan: step one", [], None)
    b = RenderedPrompt(smol.encode("The plan: stage one"), "The plan: stage one", [], None)
    check(smol, a, b, "other")


def test_char_offset_survives_a_character_split_across_tokens(smol: Tokenizer) -> None:
    text = "東京タワーは333メートルです"
    prompt = RenderedPrompt(smol.encode(text), text, [], None)
    for offset in range(len(prompt.token_ids) + 1):
        chars = char_offset(prompt, offset, smol)
        assert chars is not None and text.startswith(smol.decode(prompt.token_ids[:offset]).rstrip("\ufffd"))
        assert chars <= len(text)


def test_head_ends_where_the_first_turn_starts(smol: Tokenizer) -> None:
    prompt = render(smol, chat(COMMON, "hello there"), [WEATHER_TOOL])
    end = head_chars(prompt, smol)
    assert prompt.text[end:].startswith("hello there")
    assert "get_weather" in prompt.text[:end]
