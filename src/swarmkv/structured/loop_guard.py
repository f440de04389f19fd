"""The loop guard: a reply that has started to repeat itself verbatim is steered out of the loop.

A small model under a grammar can write a string value as a loop (`src/app/src/app/src/app/...`) until
`max_tokens` cuts it, and a cut reply never parses. The guard keeps a suffix automaton over each guarded
request's reply. The prompt is not in it, so a path copied from the prompt is never penalised. The reply's
longest suffix that occurred before first ended `p` tokens before the reply's end. When that occurrence
overlaps the suffix (its length n >= p), the reply's last n + p tokens repeat with period p. Once such a loop
spans at least `MIN_SPAN` tokens and `MIN_COPIES` periods, the token that would continue it has its logit
lowered by `MULTIPLIER * BASE ** k`, k being the tokens the loop has run past that point: DRY's exponential
penalty (llama.cpp's `dry_*` sampler), applied to loops only. The loop then ends within a few tokens, however
sure of it the model is, and the grammar still decides what may come instead. A copy that does not touch its
source, such as an edit's new text repeating its old text, is not a loop and is left alone.

A small model broken out of a loop inside a JSON string often resumes it in a variant (`takes a string`
becomes `accepts a string`, `1.1.1` becomes `2.2.2`), and no budget is then large enough. So a constrained
reply that looped inside a string is also steered to close that string: from the loop on, the quote token's
logit is raised by `MULTIPLIER * BASE ** (t / CLOSE_RATE)`, t being the tokens written in the string since,
until the string is closed. The grammar decides whether a quote may come; inside a JSON string an allowed
quote ends it. The string state is followed over the reply's bytes (`JsonStrings`), so it holds for JSON
replies, JSON tool calls (the markup around them has no quote) and JSON values in XML calls; an XML call's raw
text value has no quotes to close it, so there only the penalty acts.

Both the penalty and the close bias are functions of the reply's tokens alone, so they are the same whichever
way the tokens were appended (one a step, forced runs at once, after a preemption).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from swarmkv.core.scheduler import Chunk
from swarmkv.spec.suffix_automaton import SuffixAutomaton

MIN_SPAN = 32  # tokens a loop covers before it is penalised
MIN_COPIES = 3  # periods it covers (so a line written twice in a row is no loop)
MULTIPLIER = 0.8  # DRY's defaults as llama.cpp documents them
BASE = 1.75
MAX_EXPONENT = 64  # past it the penalty is already beyond any logit gap
CLOSE_RATE = 4  # tokens in a looped string per step of the close bias's exponent
# The longest repeat no penalty acts on (21). A loop of repeat n and period p is penalised when n >= p and
# n + p >= max(MIN_SPAN, MIN_COPIES p): then p <= n / (MIN_COPIES - 1), so n >= MIN_SPAN (1 - 1 / MIN_COPIES).
FREE_REPEAT = -(-MIN_SPAN * (MIN_COPIES - 1) // MIN_COPIES) - 1


class JsonStrings:
    """The quote token, and the bytes of every token holding a quote or a backslash (the only bytes that
    change whether a JSON text is inside a string)."""

    def __init__(self, quote: int, quoting: dict[int, bytes]) -> None:
        self.quote = quote
        self.quoting = quoting

    @classmethod
    def of(cls, vocab_size: int, decode: Callable[[int], bytes]) -> JsonStrings:
        """From a vocabulary's per-token bytes; the quote token is the one whose bytes are `"`."""
        quoting, quote = {}, -1
        for token in range(vocab_size):
            piece = decode(token)
            if b'"' in piece or b"\\" in piece:
                quoting[token] = piece
                if piece == b'"':
                    quote = token
        if quote < 0:
            raise ValueError("the vocabulary has no token for a lone quote")
        return cls(quote, quoting)


@dataclass
class _Reply:
    """One guarded reply: its automaton, and where its text stands in JSON strings."""

    automaton: SuffixAutomaton
    strings: JsonStrings | None  # None: no close bias (an unconstrained reply)
    in_string: bool = False
    escaped: bool = False  # the previous byte inside a string was an unescaped backslash
    looped_in_string: int = -1  # tokens written in the current string since it looped; -1: it has not

    def step_bytes(self, piece: bytes) -> bool:
        """Follow `piece`; whether a string was closed in it."""
        closed = False
        for byte in piece:
            if not self.in_string:
                self.in_string = byte == 0x22
            elif self.escaped:
                self.escaped = False
            elif byte == 0x5C:
                self.escaped = True
            elif byte == 0x22:
                self.in_string, closed = False, True
        return closed


class LoopGuard:
    """The guarded requests' replies; the engine calls add, extend, apply and drop."""

    def __init__(self) -> None:
        self._replies: dict[str, _Reply] = {}
        self.num_penalised = 0  # rows whose loop continuation was penalised
        self.num_closing = 0  # rows whose looped string's closing quote was raised

    def add(self, request_id: str, strings: JsonStrings | None = None, prefix: str = "") -> None:
        """Guard a request from its first reply token on. `strings`: steer a string it loops in to close
        (a constrained reply); `prefix`: the grammar's text the prompt already ends with."""
        reply = _Reply(SuffixAutomaton(), strings)
        reply.step_bytes(prefix.encode())
        self._replies[request_id] = reply

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """Tokens appended to a guarded request's reply (others are ignored)."""
        reply = self._replies.get(request_id)
        if reply is None:
            return
        for token in tokens:
            looped = self._loop(reply.automaton) is not None  # the position `token` was sampled at
            reply.automaton.extend(token)
            if reply.strings is None:
                continue
            was_in_string, closed = reply.in_string, False
            piece = reply.strings.quoting.get(token)
            if piece is not None:
                closed = reply.step_bytes(piece)
            elif reply.escaped:  # a token without a quote or backslash: its first byte was escaped
                reply.escaped = False
            if closed or not was_in_string or not reply.in_string:  # a string ended, or one opened
                reply.looped_in_string = -1
            elif looped or reply.looped_in_string >= 0:
                reply.looped_in_string = max(reply.looped_in_string, 0) + 1

    def __contains__(self, request_id: str) -> bool:
        """Whether the request's reply is guarded (its next penalty follows its last token)."""
        return request_id in self._replies

    def drop(self, request_id: str) -> None:
        """Forget a request (finished, aborted or failed)."""
        self._replies.pop(request_id, None)

    def penalty(self, request_id: str) -> tuple[int, float] | None:
        """(token, amount) to lower the next token's logit by, while the reply is in a loop; else None."""
        reply = self._replies.get(request_id)
        return self._loop(reply.automaton) if reply is not None else None

    def closing(self, request_id: str) -> tuple[int, float] | None:
        """(quote token, amount) to raise the next token's logit by, while the reply is in a string it looped
        in; else None."""
        reply = self._replies.get(request_id)
        if reply is None or reply.strings is None or reply.looped_in_string < 0 or reply.escaped:
            return None
        exponent = min(reply.looped_in_string / CLOSE_RATE, MAX_EXPONENT)
        return reply.strings.quote, MULTIPLIER * BASE**exponent

    def draftable(self, request_id: str) -> int | None:
        """Draft tokens the request's next step may verify with no penalty or close bias on any of its rows
        (None: it is not guarded). Both act only past a loop whose repeat is longer than `FREE_REPEAT`, and a
        token appended lengthens the reply's longest repeat by at most one: from a repeat of n, the rows
        after 0 to k draft tokens are free of them while n + k <= FREE_REPEAT. Speculation under the guard is
        then exact without the guard computing a row per draft token."""
        reply = self._replies.get(request_id)
        if reply is None:
            return None
        if reply.strings is not None and reply.looped_in_string >= 0:
            # In a string that looped the close bias acts (an escaping backslash only hides it a row).
            return 0
        length, _ = reply.automaton.repeat()
        return max(0, FREE_REPEAT - length)

    @staticmethod
    def _loop(reply: SuffixAutomaton) -> tuple[int, float] | None:
        if not reply.tokens:
            return None
        length, end = reply.repeat()
        period = len(reply.tokens) - 1 - end
        if length < period:  # no earlier occurrence (end -1), or one apart from the suffix: a copy
            return None
        span, start = length + period, max(MIN_SPAN, MIN_COPIES * period)
        if span < start:
            return None
        return reply.tokens[end + 1], MULTIPLIER * BASE ** min(span - start, MAX_EXPONENT)

    def apply(
        self, sampling: Sequence[Chunk], logits: torch.Tensor, rows: Sequence[int] | None = None
    ) -> None:
        """Lower, in place, each guarded row's loop continuation and raise its looped string's closing quote
        (row `rows[i]` of `logits`, or row i, samples `sampling[i]`)."""
        for i, chunk in enumerate(sampling):
            row = rows[i] if rows is not None else i
            found = self.penalty(chunk.request_id)
            closing = self.closing(chunk.request_id)
            with torch.inference_mode():  # the runner's logits are inference tensors
                if found is not None:
                    logits[row, found[0]] -= found[1]
                    self.num_penalised += 1
                if closing is not None:
                    logits[row, closing[0]] += closing[1]
                    self.num_closing += 1
