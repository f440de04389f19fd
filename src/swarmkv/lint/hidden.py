"""Breaks hidden behind a volatile value: where a prompt would still part from an earlier one if the dates,
times and ids in their heads were equal (one agent's reordered tools behind everyone's timestamp).

Two tools: `mask` writes each volatile value of a head as a placeholder of its kind, so that prompts can
be matched as if their values were equal; `align` gives an earlier prompt the later one's first values,
so that the later prompt's own tokens show where the two part next.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from swarmkv.breaks.causes import RenderedPrompt
from swarmkv.breaks.patterns import Volatile, VolatileScanner

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class MaskedHead:
    """A prompt's text with the volatile values of its head replaced, and those values."""

    text: str
    values: list[Volatile]  # spans in the prompt's own text


def mask(text: str, head_chars: int, scanner: VolatileScanner) -> MaskedHead:
    """`text` with every volatile value in its first `head_chars` characters written as `<kind>`."""
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
    earlier_values: list[Volatile],
    later: RenderedPrompt,
    later_values: list[Volatile],
    num_values: int,
    encode: Encode,
) -> RenderedPrompt | None:
    """`earlier` with the later prompt's first `num_values` volatile values in place of its own (None when
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
