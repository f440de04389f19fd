"""One chooser over both draft sources: the text drafter (`Drafter`: the request's context, its siblings' and its
session's replies) and a model's multi-token-prediction (MTP) layer, which drafts new prose too.

The scheduler asks it for a request's draft (`propose`), as it asks the text drafter. Per request it keeps
what each source's drafts yielded: the MTP layer's chance that a draft token is accepted once those before it
were (an estimate from its accepted and drafted positions) and the text drafts' accepted share. An MTP draft of
k tokens is expected to yield a + a^2 + ... + a^k tokens and costs k passes of the LM head, each `head_cost`
of a step (the engine measures it); its length is the one with the most tokens per unit of step time, none
when no length beats a plain step. A text draft costs no head pass: the chooser takes the source with the
higher expected tokens per unit of time. A request whose MTP drafts stop paying backs off (its MTP drafts are
skipped for 1, 2, 4, ... steps, then one token is tried again). While a back-off has two or more steps to go,
the layer's pass over the request's new rows is skipped too (`keeps_kv`): a model whose MTP layer predicts
nothing then costs a pass now and then, and the positions skipped hold no MTP KV of their own, which a later
draft reads as it is (it can cost acceptance, never a token).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from swarmkv.spec.drafter import MAX_BACKOFF_STEPS, Draft, Drafter

PRIOR_ACCEPTED, PRIOR_DRAFTED = 1.0, 2.0  # an MTP layer starts at an even chance a token, over two tokens
DECAY = 0.9  # each verification's weight against the history (an exponential average over ~10 steps)


@dataclass
class _Yield:
    """A source's accepted and drafted positions, decayed: their ratio estimates the acceptance chance."""

    accepted: float = PRIOR_ACCEPTED
    drafted: float = PRIOR_DRAFTED

    @property
    def rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def add(self, accepted: int, drafted: int) -> None:
        self.accepted = DECAY * self.accepted + accepted
        self.drafted = DECAY * self.drafted + drafted


@dataclass
class _Request:
    mtp: _Yield = field(default_factory=_Yield)
    text: _Yield = field(default_factory=_Yield)
    proposal: tuple[int, ...] = ()  # the MTP layer's draft after the request's last token
    source: str | None = None  # the source of the draft awaiting verification
    wait_steps: int = 0  # MTP drafts skipped before the next try
    misses: int = 0  # MTP drafts in a row with nothing accepted


def mtp_draft_length(rate: float, head_cost: float, max_tokens: int) -> int:
    """The MTP draft length with the most expected tokens per unit of step time, (1 + a + ... + a^k) /
    (1 + k * head_cost); 0 when no length beats a plain step."""
    best, best_rate = 0, 1.0
    for k in range(1, max_tokens + 1):
        per_time = (1 + _expected(rate, k)) / (1 + k * head_cost)
        if per_time > best_rate * 1.02:  # a margin: a draft must pay for its own bookkeeping
            best, best_rate = k, per_time
    return best


class DraftChooser:
    """Drafts from the text drafter, the MTP layer, or both, whichever is expected to yield more."""

    def __init__(
        self,
        text: Drafter | None,
        mtp_tokens: int,
        vet: Callable[[str, tuple[int, ...]], int] | None = None,
    ) -> None:
        """`text`: the text drafter (None: MTP only); `mtp_tokens`: an MTP draft's length at most (0: no MTP
        layer). `vet`: the processors' draft limit, applied to MTP drafts as the text drafter applies it."""
        self.text = text
        self.mtp_tokens = mtp_tokens
        self.vet = vet
        self.head_cost = 0.1  # an LM head pass as a share of a step (the engine measures it: `observe_cost`)
        self._requests: dict[str, _Request] = {}

    # What the Drafts processor forwards.

    def add(self, request_id: str, prompt: list[int], salt: str | None, session_id: str | None) -> None:
        self._requests[request_id] = _Request()
        if self.text is not None:
            self.text.add(request_id, prompt, salt, session_id)

    def extend(self, request_id: str, tokens: list[int]) -> None:
        if self.text is not None:
            self.text.extend(request_id, tokens)

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        if self.text is not None:
            self.text.finish(request_id)

    def backing_off(self, request_id: str) -> bool:
        """Whether the request's next proposal is skipped without reading its tokens."""
        req = self._requests.get(request_id)
        if req is None:
            return True
        mtp_idle = not self.mtp_tokens or req.wait_steps > 0
        return mtp_idle and (self.text is None or self.text.backing_off(request_id))

    # The MTP side, which the engine drives after each step.

    def mtp_length(self, request_id: str) -> int:
        """How many tokens the MTP layer should draft for the request's next step (0: none); counts down a
        back-off."""
        req = self._requests.get(request_id)
        if req is None or not self.mtp_tokens:
            return 0
        if req.wait_steps:
            req.wait_steps -= 1
            return 0
        length = mtp_draft_length(req.mtp.rate, self.head_cost, self.mtp_tokens)
        return max(length, 1) if req.misses else length  # a back-off ends with a one-token try

    def keeps_kv(self, request_id: str) -> bool:
        """Whether the MTP layer should run over the request's new rows this step (write their KV): not while
        its MTP drafts back off for two or more steps yet."""
        req = self._requests.get(request_id)
        return req is not None and req.wait_steps < 2

    def set_proposal(self, request_id: str, tokens: list[int]) -> None:
        """The MTP layer's draft after the request's last token."""
        req = self._requests.get(request_id)
        if req is not None:
            req.proposal = tuple(tokens)

    def observe_cost(self, head_s: float, step_s: float) -> None:
        """An LM head pass took `head_s` beside a step of `step_s`: the cost the draft lengths weigh."""
        if step_s > 0:
            self.head_cost = DECAY * self.head_cost + (1 - DECAY) * min(head_s / step_s, 1.0)

    # The scheduler's and the executor's side.

    def propose(self, request_id: str, max_tokens: int) -> Draft | None:
        """The better of the two sources' drafts of at most `max_tokens` tokens, or None."""
        req = self._requests.get(request_id)
        if req is None or max_tokens <= 0:
            return None
        mtp, req.proposal = req.proposal[:max_tokens], ()
        if mtp and self.vet is not None:
            mtp = mtp[: self.vet(request_id, mtp)]
        text = self.text.propose(request_id, max_tokens) if self.text is not None else None
        if text is not None and (
            not mtp or len(text.tokens) * req.text.rate >= _expected(req.mtp.rate, len(mtp))
        ):
            req.source = "text"
            return text
        if text is not None:
            self.text.unused(request_id)  # type: ignore[union-attr]
        req.source = "mtp" if mtp else None
        return Draft(mtp, "mtp", 0) if mtp else None

    def record(self, request_id: str, num_drafted: int, num_accepted: int) -> str | None:
        """The latest draft's outcome; its source (None if unknown)."""
        req = self._requests.get(request_id)
        if req is None or req.source is None:
            return None
        source, req.source = req.source, None
        if source == "text":
            req.text.add(num_accepted, num_drafted)
            assert self.text is not None
            return self.text.record(request_id, num_drafted, num_accepted)
        # Positions tried: every accepted one, and the first rejected one.
        req.mtp.add(num_accepted, min(num_drafted, num_accepted + 1))
        if num_accepted:
            req.misses = 0
        else:
            req.misses += 1
            req.wait_steps = min(2**req.misses - 1, MAX_BACKOFF_STEPS)
        return "mtp"


def _expected(rate: float, length: int) -> float:
    """Tokens a draft of `length` is expected to yield at an acceptance chance of `rate` a token."""
    return sum(rate**k for k in range(1, length + 1))
