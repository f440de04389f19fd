"""Breaks hidden behind a value: where a prompt would still part from an earlier one if the dates, times,
ids and per-instance environment values (paths, git hashes, ...) in their heads were equal (one agent's
reordered tools behind everyone's timestamp, a memory path behind a git hash).

Two tools: `mask` writes each value of a head as a placeholder of its kind, so that prompts can be matched
as if their values were equal; `align` gives an earlier prompt the later one's first values, so that the
later prompt's own tokens show where the two part next.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from swarmkv.breaks.causes import RenderedPrompt
from swarmkv.breaks.environment import EnvScanner, EnvValue
from swarmkv.breaks.patterns import Volatile, VolatileScanner

Encode = Callable[[str], list[int]]
Value = Volatile | EnvValue  # a span of text two agents write differently; its `kind` is a break's cause


class ValueScanner:
    """The values of a text: environment values, and the dates, times and ids outside them."""

    def __init__(self) -> None:
        self._volatile = VolatileScanner()
        self._env = EnvScanner()

    def spans(self, text: str) -> list[Value]:
        """Every value in `text`, in order, none overlapping."""
        env = self._env.spans(text)
        volatile = [v for v in self._volatile.spans(text) if not any(_overlap(v, e) for e in env)]
        return sorted([*env, *volatile], key=lambda v: v.start)


def _overlap(a: Value, b: Value) -> bool:
    return a.start < b.end and b.start < a.end


@dataclass(frozen=True)
class MaskedHead:
    """A prompt's text with the volatile values of its head replaced, and those values."""

    text: str
    values: list[Value]  # spans in the prompt's own text


def mask(text: str, head_chars: int, scanner: ValueScanner) -> MaskedHead:
    """`text` with every value in its first `head_chars` characters written as `<kind>`."""
    values = scanner.spans(text[:head_chars])
    if not values:
        return MaskedHead(text, [])
    pieces, at = [], 0
    for value in values:
        pieces += [text[at : value.start], f"<{value.kind}>"]
        at = value.end
    pieces.append(text[at:])
    return MaskedHead("".join(pieces), values)


def align(
    earlier: RenderedPrompt,
    earlier_values: list[Value],
    later: RenderedPrompt,
    later_values: list[Value],
    num_values: int,
    encode: Encode,
) -> RenderedPrompt | None:
    """`earlier` with the later prompt's first `num_values` values in place of its own (None when
    the two heads do not hold the same kinds of values in the same order)."""
    if [v.kind for v in earlier_values] != [v.kind for v in later_values] or not earlier_values:
        return None
    pieces, at, swaps = [], 0, {}
    for old, new in zip(earlier_values[:num_values], later_values[:num_values], strict=True):
        old_text, new_text = earlier.text[old.start : old.end], later.text[new.start : new.end]
        pieces += [earlier.text[at : old.start], new_text]
        at = old.end
        swaps[old_text] = new_text
    pieces.append(earlier.text[at:])
    text = "".join(pieces)
    messages = [_swapped(m, swaps) if m.get("role") == "system" else m for m in earlier.messages]
    return RenderedPrompt(encode(text), text, messages, earlier.tools)


def _swapped(message: dict[str, Any], swaps: dict[str, str]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, str):
        return message
    for old, new in swaps.items():
        content = content.replace(old, new)
    return {**message, "content": content}
