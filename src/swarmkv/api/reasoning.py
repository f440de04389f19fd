"""A thinking model's `<think>...</think>` reasoning, split from its reply's content piece by piece.

Qwen3-style templates (they have an `enable_thinking` switch) let the model open its reply with a
`<think>` block; Qwen3.5's writes the `<think>` into the prompt itself, so the reply starts inside the block.
The reasoning is the text of that one leading block, without the whitespace that lays it out; the content is
what follows `</think>`, its leading whitespace dropped. A `<think>` anywhere later is content, and a block
never closed (a reply cut off by its length) is all reasoning. Text that may still become a tag is held back
until the next piece decides, so a streamed reply splits exactly as the whole one does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

OPEN_THINK = "<think>"
CLOSE_THINK = "</think>"
THINKING_SWITCH = "enable_thinking"


def is_thinking_template(template_source: str | None) -> bool:
    """Whether a chat template is a thinking model's: it reads the `enable_thinking` switch."""
    return template_source is not None and THINKING_SWITCH in template_source


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open `<think>`, so the reply starts as reasoning."""
    return prompt_text.rstrip().endswith(OPEN_THINK)


def reasoning_splitter(
    template_source: str | None, prompt_text: str, enabled: bool = True
) -> ReasoningSplitter | None:
    """A splitter for one reply to `prompt_text`; None when the template is not a thinking model's or its
    thinking is switched off (`enable_thinking` false), where the reply is content as it was written."""
    if not (enabled and is_thinking_template(template_source)):
        return None
    return ReasoningSplitter(prompt_opens_thinking(prompt_text))


@dataclass(frozen=True)
class ReasoningSplit:
    """What a piece of reply text added to the reasoning and to the content."""

    reasoning: str = ""
    content: str = ""

    def then(self, later: ReasoningSplit) -> ReasoningSplit:
        """This split followed by `later`, as one."""
        return ReasoningSplit(self.reasoning + later.reasoning, self.content + later.content)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Splits reply text, piece by piece, into reasoning and content."""

    def __init__(self, opened: bool = False) -> None:
        # start: before the reply's first text decides; reasoning: inside the block; after: past `</think>`,
        # dropping whitespace; content: everything else is content.
        self._state: Literal["start", "reasoning", "after", "content"] = "reasoning" if opened else "start"
        self._buffer = ""
        self._reasoning_started = False  # leading whitespace of the reasoning is layout
        self._pending_space = ""  # the reasoning's trailing whitespace, held until more reasoning follows
        # Output tokens of the reasoning block, its tags included (what Responses reports as reasoning tokens);
        # those fed before the reply's start decides wait in `_undecided_tokens`.
        self.num_tokens = 0
        self._undecided_tokens = 0
        self._num_chars = 0  # text fed so far
        self._closed_at: int | None = None  # where `</think>` ended, if it did in the latest piece

    def feed(self, text: str, num_tokens: int = 0, token_ends: tuple[int, ...] = ()) -> ReasoningSplit:
        """Split newly generated text, the reply's next `num_tokens` tokens; `token_ends`: where each of them
        ends in the reply's text, when there are several (a draft's, a forced run's)."""
        before = self._state
        self._num_chars += len(text)
        self._closed_at = None
        split = self._feed(text)
        if self._closed_at is not None and num_tokens > 1 and len(token_ends) == num_tokens:
            # The block closed inside the piece: its tokens up to the one holding the tag's end.
            num_tokens = 1 + sum(1 for end in token_ends[:-1] if end < self._closed_at)
        if before == "reasoning":
            self.num_tokens += num_tokens
        elif before == "start":
            self._undecided_tokens += num_tokens
            if self._state in ("reasoning", "after") or self._closed_at is not None:  # opened, maybe closed
                self.num_tokens += self._undecided_tokens
            if self._state != "start":
                self._undecided_tokens = 0
        return split

    def _feed(self, text: str) -> ReasoningSplit:
        self._buffer += text
        reasoning, content = "", ""
        while True:
            if self._state == "start":
                stripped = self._buffer.lstrip()
                if stripped.startswith(OPEN_THINK):
                    self._buffer = stripped[len(OPEN_THINK) :]
                    self._state = "reasoning"
                    continue
                if OPEN_THINK.startswith(stripped):  # empty or a partial tag: wait
                    break
                self._state = "content"
            elif self._state == "reasoning":
                end = self._buffer.find(CLOSE_THINK)
                if end < 0:
                    keep = _held_prefix(self._buffer, CLOSE_THINK)
                    reasoning += self._reasoning(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                reasoning += self._reasoning(self._buffer[:end])
                self._buffer = self._buffer[end + len(CLOSE_THINK) :]
                self._closed_at = self._num_chars - len(self._buffer)
                self._pending_space = ""
                self._state = "after"
            elif self._state == "after":
                self._buffer = self._buffer.lstrip()
                if not self._buffer:
                    break
                self._state = "content"
            else:
                content += self._buffer
                self._buffer = ""
                break
        return ReasoningSplit(reasoning, content)

    def finish(self) -> ReasoningSplit:
        """Flush at the end of generation: an unclosed block is reasoning, undecided text is content."""
        buffer, self._buffer = self._buffer, ""
        if self._state == "reasoning":
            return ReasoningSplit(reasoning=self._reasoning(buffer))
        if self._state in ("start", "content"):
            return ReasoningSplit(content=buffer)
        return ReasoningSplit()

    def _reasoning(self, text: str) -> str:
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        body = text.rstrip()
        if not body:
            self._pending_space += text
            return ""
        out = self._pending_space + body
        self._pending_space = text[len(body) :]
        return out
