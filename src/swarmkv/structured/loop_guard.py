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

The penalty is a function of the reply's tokens alone, so it is the same whichever way they were appended
(one a step, forced runs at once, after a preemption).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from swarmkv.core.scheduler import Chunk
from swarmkv.spec.suffix_automaton import SuffixAutomaton

MIN_SPAN = 32  # tokens a loop covers before it is penalised
MIN_COPIES = 3  # periods it covers (so a line written twice in a row is no loop)
MULTIPLIER = 0.8  # DRY's defaults as llama.cpp documents them
BASE = 1.75
MAX_EXPONENT = 64  # past it the penalty is already beyond any logit gap


class LoopGuard:
    """The guarded requests' replies; the engine calls add, extend, apply and drop."""

    def __init__(self) -> None:
        self._replies: dict[str, SuffixAutomaton] = {}
        self.num_penalised = 0  # rows whose loop continuation was penalised

    def add(self, request_id: str) -> None:
        """Guard a request from its first reply token on."""
        self._replies[request_id] = SuffixAutomaton()

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """Tokens appended to a guarded request's reply (others are ignored)."""
        reply = self._replies.get(request_id)
        if reply is not None:
            for token in tokens:
                reply.extend(token)

    def drop(self, request_id: str) -> None:
        """Forget a request (finished, aborted or failed)."""
        self._replies.pop(request_id, None)

    def penalty(self, request_id: str) -> tuple[int, float] | None:
        """(token, amount) to lower the next token's logit by, while the reply is in a loop; else None."""
        reply = self._replies.get(request_id)
        if reply is None or not reply.tokens:
            return None
        length, end = reply.repeat()
        period = len(reply.tokens) - 1 - end
        if length < period:  # no earlier occurrence (end -1), or one apart from the suffix: a copy
            return None
        span, start = length + period, max(MIN_SPAN, MIN_COPIES * period)
        if span < start:
            return None
        return reply.tokens[end + 1], MULTIPLIER * BASE ** min(span - start, MAX_EXPONENT)

    def apply(self, sampling: Sequence[Chunk], logits: torch.Tensor) -> None:
        """Lower, in place, each guarded row's loop continuation (row i of `logits` samples `sampling[i]`)."""
        for row, chunk in enumerate(sampling):
            found = self.penalty(chunk.request_id)
            if found is not None:
                token, amount = found
                with torch.inference_mode():  # the runner's logits are inference tensors
                    logits[row, token] -= amount
                self.num_penalised += 1
