"""A constrained reply's way to end from where its grammar stands: the tokens the engine forces once the tokens
left to `max_tokens` come down to them, so a reply its length cuts still parses.

llguidance has no shortest-completion query, so `Closer` searches one out over the matcher itself (a check
or a step of it costs about a microsecond): depth first over single bytes, the grammar's forced runs taken
whole, the bytes that close first (a quote inside a string; brackets, then the shortest values, outside
one), under a budget of checks. The bytes found are then tokenized as the model's vocabulary would, and the
shorter of the two spellings the grammar accepts is the ending. It is the ending found, not always the
shortest: forcing it where it fits exactly still leaves a reply that parses. JSON (schemas, any object, Hermes
calls) always has one; free text that only a closing tag ends (the XML call form's values) finds none, and
nothing is forced there.
"""

from __future__ import annotations

import llguidance

MAX_ENDING_BYTES = 256  # deeper than any ending a JSON schema of sane nesting needs
MAX_CHECKS = 4096  # single-token checks a search may spend (a few milliseconds at worst)

# Outside a string: close what is open, then the shortest values, then what separates; whitespace goes last.
_OUTSIDE = b'}]0"ntf[{-,:<>/'


class Closer:
    """Endings over one tokenizer's vocabulary."""

    def __init__(self, tokenizer: llguidance.LLTokenizer) -> None:
        self.tokenizer = tokenizer
        # A single byte's own token (byte-level vocabularies have one for each byte).
        self.byte_tokens: dict[int, int] = {}
        for byte in range(256):
            ids = tokenizer.tokenize_bytes(bytes([byte]))
            if len(ids) == 1:
                self.byte_tokens[byte] = ids[0]
        rest = [b for b in range(33, 256) if b not in _OUTSIDE] + list(b" \n\t\r")
        self._outside = [self.byte_tokens[b] for b in [*_OUTSIDE, *rest] if b in self.byte_tokens]
        self._quote, self._letter = self.byte_tokens.get(ord('"')), self.byte_tokens.get(ord("a"))

    def ending(self, matcher: llguidance.LLMatcher) -> list[int] | None:
        """Tokens taking `matcher` to a state where its grammar may end ([] when it may end now), or None when
        the search found none within its budget. The matcher is left as it was."""
        path: list[int] = []
        if not self._search(matcher, path, [MAX_CHECKS]):
            return None
        matcher.rollback(len(path))
        data = self.tokenizer.decode_bytes(path)
        retokenized = self.tokenizer.tokenize_bytes(data)
        if len(retokenized) < len(path) and self._ends(matcher, retokenized):
            return retokenized
        return path

    def _search(self, matcher: llguidance.LLMatcher, path: list[int], budget: list[int]) -> bool:
        """Depth first from the matcher's state; on success the matcher has consumed `path`."""
        if matcher.is_accepting():
            return True
        if len(path) >= MAX_ENDING_BYTES or budget[0] <= 0:
            return False
        forced = matcher.compute_ff_tokens()
        if forced:
            matcher.consume_tokens(forced)
            path.extend(forced)
            if self._search(matcher, path, budget):
                return True
            matcher.rollback(len(forced))
            del path[len(path) - len(forced) :]
            return False
        in_string = self._in_string(matcher)
        candidates = self._outside
        if in_string:  # the quote that closes it, or a letter where the string is below its minimum length
            quote, letter = self._quote, self._letter
            assert quote is not None and letter is not None  # `_in_string` holds only with both
            candidates = [quote] if matcher.validate_tokens([quote]) == 1 else [letter]
        for token in candidates:
            budget[0] -= 1
            if budget[0] < 0:
                return False
            if matcher.validate_tokens([token]) != 1:
                continue
            matcher.consume_token(token)
            path.append(token)
            # A quote that leaves us inside a string (free text) closes nothing: it is no way out.
            no_way_out = in_string and token == self._quote and self._in_string(matcher)
            if not no_way_out and self._search(matcher, path, budget):
                return True
            matcher.rollback(1)
            path.pop()
        return False

    def _in_string(self, matcher: llguidance.LLMatcher) -> bool:
        """Whether a letter may come next: inside a string (JSON has no bare letter outside one but in its
        literals, and those are forced runs once begun)."""
        return (
            self._quote is not None
            and self._letter is not None
            and matcher.validate_tokens([self._letter]) == 1
        )

    @staticmethod
    def _ends(matcher: llguidance.LLMatcher, tokens: list[int]) -> bool:
        """Whether the grammar accepts `tokens` and may end after them (the matcher left as it was)."""
        if matcher.validate_tokens(tokens) != len(tokens):
            return False
        matcher.consume_tokens(tokens)
        accepting = bool(matcher.is_accepting())
        matcher.rollback(len(tokens))
        return accepting
