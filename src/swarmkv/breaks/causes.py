"""Why a prompt stopped sharing an earlier one's tokens: the cause of a prefix break, with evidence.

`classify` looks at the first character where two rendered prompts differ, in this order: per-instance
environment text there (`per_instance_env`: a working directory, a path, a git hash, a user or host name,
in the head or on a line that says what it is; also a date in a new instance's first request), a date or
time there (`timestamp`), a UUID, hex string or nonce there (`random_id`), the tools (the break moves on
when the later prompt is rendered with the earlier one's tools: `tool_order` for the same set, else
`tool_set`), then where it falls. In the head (system messages and tools) it is `private_before_shared`
when more system-prompt text is shared after the break than before it, else `system_edit`; after the
head it is `history_rewrite` (an earlier turn rendered differently). A completion prompt's is `other`.
A `per_instance_env` break says what the value is (`working directory /tmp/ws-b`): one name for one kind
of text, whichever harness wrote it and wherever it stands.

This module needs only the tokenizer, `patterns` and `environment`, so the server can classify breaks as
it sees them.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from swarmkv.breaks.environment import EnvValue, describe, env_at
from swarmkv.breaks.patterns import Volatile, volatile_at
from swarmkv.errors import InvalidRequestError
from swarmkv.prefix import common_prefix_length
from swarmkv.tokenizer import Tokenizer

CAUSES: tuple[str, ...] = (
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

MAX_EVIDENCE_CHARS = 80
_MIN_EVIDENCE_CHARS = 20  # an evidence line break or word break before this many characters is passed over
_MAX_WORD_BACK = 40  # how far back evidence starting inside a word (a path) goes to the word's start
# A user message no prompt contains: rendering the head followed by it shows where the head ends.
_PROBE = "\u0000swarmkv-lint-probe\u0000"


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt as the engine sees it: token ids, the template's text, and what the template was given."""

    token_ids: list[int]
    text: str  # the template's rendered text
    messages: list[dict[str, Any]]  # as given to the template
    tools: list[dict[str, Any]] | None


@dataclass(frozen=True)
class Break:
    """Where a prompt stopped sharing an earlier one's tokens, and why."""

    offset: int  # tokens shared with the earlier prompt: the first diverging token's index
    cause: str  # one of CAUSES
    text: str  # evidence: a short snippet of the later prompt's text at the divergence, cut at word breaks
    detail: str = ""  # what a per_instance_env value is, and the value: `working directory /tmp/ws-b`


def divergence(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two token lists."""
    return common_prefix_length(list(a), list(b))


def common_chars(a: str, b: str) -> int:
    """Length of the common prefix of two strings."""
    return common_prefix_length(a, b)


def char_offset(prompt: RenderedPrompt, offset: int, tokenizer: Tokenizer) -> int | None:
    """Characters of `prompt.text` before token `offset`; None when the tokens do not spell the text."""
    prefix = tokenizer.decode(prompt.token_ids[:offset], skip_special_tokens=False)
    # Byte-level BPE: a token may end inside a multi-byte character, which decodes to U+FFFD.
    for candidate in (prefix, prefix.rstrip("\ufffd")):
        if prompt.text.startswith(candidate):
            return len(candidate)
    return None


def head_chars(prompt: RenderedPrompt, tokenizer: Tokenizer) -> int:
    """Characters of the rendered head: the leading system messages and the tools, up to the first turn."""
    messages = prompt.messages
    num_system = next((i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages))
    if not messages or num_system == len(messages):
        return len(prompt.text)
    probe = [*messages[:num_system], {"role": "user", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(probe, tools=prompt.tools, add_generation_prompt=False)
    except InvalidRequestError:
        return 0
    return common_chars(text, prompt.text)


def classify(
    earlier: RenderedPrompt,
    later: RenderedPrompt,
    offset: int,
    tokenizer: Tokenizer,
    first_request: bool = False,
) -> Break:
    """Why `later` shares only `offset` tokens of `earlier`: the cause, with the later text there.
    `first_request`: `later` opens a new instance's session (a date there is the instance's, not a clock)."""
    differ = common_chars(earlier.text, later.text)  # the first character that differs
    start = char_offset(later, offset, tokenizer)
    start = differ if start is None else min(start, differ)
    head_end: int | None = None

    def in_head() -> bool:
        nonlocal head_end
        if head_end is None:
            head_end = _head_end(earlier, later, tokenizer)
        return differ < head_end

    env = _env_value(earlier, later, differ, in_head)
    if env is not None:
        prompt, env_value = env
        evidence_start = min(start, env_value.start) if prompt is later else start
        detail = describe(prompt.text, env_value)
        return Break(offset, env_value.kind, _evidence(later.text, evidence_start), detail)
    value = volatile_at(later.text, differ)
    dropped = value is None
    if dropped:
        value = volatile_at(earlier.text, differ)  # a value the later prompt dropped
    if value is not None:
        text = later.text if not dropped else earlier.text
        evidence_start = start if dropped else min(start, value.start)
        if first_request and _is_date(text, value):
            detail = f"date {text[value.start : value.end]}"
            return Break(offset, "per_instance_env", _evidence(later.text, evidence_start), detail)
        return Break(offset, value.kind, _evidence(later.text, evidence_start))
    evidence = _evidence(later.text, start)
    tools = _tools_cause(earlier, later, differ, tokenizer)
    if tools is not None:
        return Break(offset, tools, evidence)
    if not later.messages or not earlier.messages:
        return Break(offset, "other", evidence)
    if in_head():
        assert head_end is not None
        shared_after = _shared_system_lines(earlier, later, differ, head_end)
        cause = "private_before_shared" if shared_after > differ else "system_edit"
        return Break(offset, cause, evidence)
    return Break(offset, "history_rewrite", evidence)


def is_env_break(earlier: RenderedPrompt, later: RenderedPrompt, differ: int, head_end: int) -> bool:
    """Whether the prompts part at per-instance environment text (`head_end`: where the head ends)."""
    return _env_value(earlier, later, differ, lambda: differ < head_end) is not None


def _env_value(
    earlier: RenderedPrompt, later: RenderedPrompt, differ: int, in_head: Callable[[], bool]
) -> tuple[RenderedPrompt, EnvValue] | None:
    """The environment value at the divergence (the later prompt's, else one the later prompt dropped), if
    it is environment text there: on a line that says what it is, or anywhere in the head."""
    for prompt in (later, earlier):
        value = env_at(prompt.text, differ)
        if value is not None and (value.cued or (prompt.messages and in_head())):
            return prompt, value
    return None


def _head_end(earlier: RenderedPrompt, later: RenderedPrompt, tokenizer: Tokenizer) -> int:
    if not later.messages or not earlier.messages:
        return 0
    return max(head_chars(earlier, tokenizer), head_chars(later, tokenizer))


def _is_date(text: str, value: Volatile) -> bool:
    """A date alone (a clock in it would change within a session)."""
    return value.kind == "timestamp" and ":" not in text[value.start : value.end]


def _tools_cause(
    earlier: RenderedPrompt, later: RenderedPrompt, differ: int, tokenizer: Tokenizer
) -> str | None:
    """`tool_order` or `tool_set` when the later prompt, given the earlier tools, shares more of it."""
    if not later.messages or _canonical(earlier.tools) == _canonical(later.tools):
        return None
    try:
        swapped = tokenizer.apply_chat_template(later.messages, tools=earlier.tools)
    except InvalidRequestError:
        return None
    if common_chars(swapped, earlier.text) <= differ:
        return None
    same_set = sorted(_canonical(earlier.tools)) == sorted(_canonical(later.tools))
    return "tool_order" if same_set else "tool_set"


def _canonical(tools: list[dict[str, Any]] | None) -> list[str]:
    return [json.dumps(tool, sort_keys=True) for tool in tools or []]


def _shared_system_lines(earlier: RenderedPrompt, later: RenderedPrompt, differ: int, head_end: int) -> int:
    """Characters of system-prompt lines both heads have after the line the break is on (tools, which
    the template may place after the system text, do not count: an edit above them is no private text)."""
    system = {
        line
        for m in later.messages
        if m.get("role") == "system" and isinstance(m.get("content"), str)
        for line in m["content"].splitlines()
        if line.strip()
    }
    earlier_lines = set(earlier.text[differ:head_end].splitlines())
    later_lines = later.text[differ:head_end].splitlines()[1:]
    return sum(len(line) for line in later_lines if line in system and line in earlier_lines)


def _evidence(text: str, start: int) -> str:
    """Up to MAX_EVIDENCE_CHARS of `text` from the start of the word at `start` (of its part, in a long
    word such as a path), ending at a line break past its first characters, else at the last word break
    that fits."""
    while start < len(text) - 1 and text[start] in " \t":  # a token's leading space: from the word
        start += 1
    begin = start
    if start < len(text) and not text[start].isspace():
        while begin > max(0, start - _MAX_WORD_BACK) and not text[begin - 1].isspace():
            begin -= 1
        if begin > 0 and not text[begin - 1].isspace():  # a word too long to show whole (a path):
            begin = start  # from the start of its part at the divergence
            while begin > max(0, start - _MAX_WORD_BACK) and text[begin - 1].isalnum():
                begin -= 1
    snippet = text[begin : begin + MAX_EVIDENCE_CHARS + 1]
    line_break = snippet.find("\n", _MIN_EVIDENCE_CHARS)
    if line_break > 0:
        return snippet[:line_break]
    if len(snippet) <= MAX_EVIDENCE_CHARS:
        return snippet
    word_break = max(snippet.rfind(" ", _MIN_EVIDENCE_CHARS), snippet.rfind("\t", _MIN_EVIDENCE_CHARS))
    if word_break > 0:
        return snippet[:word_break]
    # One word longer than the evidence (a path): cut where one of its parts ends.
    part_end = max(
        (
            i
            for i in range(_MIN_EVIDENCE_CHARS, MAX_EVIDENCE_CHARS)
            if snippet[i - 1].isalnum() != snippet[i].isalnum()
        ),
        default=MAX_EVIDENCE_CHARS,
    )
    return snippet[:part_end]
