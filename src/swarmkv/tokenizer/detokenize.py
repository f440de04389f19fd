"""Incremental detokenization for streaming: text deltas that never cut a UTF-8 character in two.

Each step decodes only a short window of ids (the scheme vLLM uses): `prefix_offset..read_offset`
is text already emitted, kept as context so the next token decodes as it would in the full text;
`read_offset..` is what is new. A step's cost is proportional to the window, not to the output.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# A few prompt tokens decoded ahead of the first generated one give it the context it has in the
# full text (a byte sequence cut by the prompt's end, a decoder's leading-space rule).
PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT = "\ufffd"


class Decoder(Protocol):
    """Anything that turns token ids into text, like `swarmkv.tokenizer.Tokenizer`."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text `ids` spell."""
        ...


class IncrementalDetokenizer:
    """Turns a growing list of generated ids into the text each new step adds."""

    def __init__(
        self, tokenizer: Decoder, prompt_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # Offsets index the virtual sequence `context + generated`.
        self._context = tuple(prompt_ids[max(len(prompt_ids) - PROMPT_CONTEXT_TOKENS, 0) :])
        self._prefix_offset = 0
        self._read_offset = len(self._context)

    def step(self, generated_ids: Sequence[int], num_ids: int | None = None) -> str:
        """New text after `generated_ids` (all ids generated so far, or their first `num_ids`) grew; "" while a
        character is incomplete."""
        return self._advance(generated_ids, hold_incomplete=True, num_ids=num_ids)

    def flush(self, generated_ids: Sequence[int]) -> str:
        """The text still held back at the end of generation, incomplete trailing bytes included."""
        return self._advance(generated_ids, hold_incomplete=False)

    def _advance(
        self, generated_ids: Sequence[int], hold_incomplete: bool, num_ids: int | None = None
    ) -> str:
        end = len(self._context) + (len(generated_ids) if num_ids is None else num_ids)
        assert end >= self._read_offset, "generated ids may only grow"
        prefix_text = self._decode(self._window(generated_ids, self._prefix_offset, self._read_offset))
        new_text = self._decode(self._window(generated_ids, self._prefix_offset, end))
        # A trailing U+FFFD is a character whose remaining bytes are in tokens not generated yet.
        if len(new_text) <= len(prefix_text) or (hold_incomplete and new_text.endswith(_REPLACEMENT)):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, end
        return new_text[len(prefix_text) :]

    def _window(self, generated_ids: Sequence[int], start: int, end: int) -> list[int]:
        n = len(self._context)
        head = list(self._context[start:end]) if start < n else []
        return head + list(generated_ids[max(start - n, 0) : max(end - n, 0)])

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens) if ids else ""
