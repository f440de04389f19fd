"""Speculative decoding's drafts as a per-request processor: a request's reply feeds its drafter, and each
verification's outcome sets its next draft's length and back-off. With a model's MTP layer drafting too, the
drafter is a `DraftChooser` over both sources (the engine hands it the MTP layer's drafts after each step)."""

from __future__ import annotations

from collections.abc import Callable

import swarmkv.resolve as resolve
from swarmkv.core.config import EngineConfig
from swarmkv.core.processors import Ending, RequestProcessor
from swarmkv.core.sequence import FinishReason, Sequence
from swarmkv.core.stats import EngineCounters
from swarmkv.spec import Drafter
from swarmkv.spec.chooser import DraftChooser


class Drafts(RequestProcessor):
    """The drafter's side of each request; the scheduler asks the drafter for drafts, the executor reports
    what verification accepted (`verified`)."""

    def __init__(self, drafter: Drafter | DraftChooser, counters: EngineCounters) -> None:
        self.drafter = drafter
        self.counters = counters

    @classmethod
    def of(
        cls,
        config: EngineConfig,
        counters: EngineCounters,
        limit: Callable[[str, tuple[int, ...]], int],
        lookahead: bool,
        mtp: bool = False,
    ) -> Drafts:
        """Drafts as `config` sets them, each cut to `limit` (the processors' draft limit); `mtp`: the model holds
        an MTP layer to draft with. Under async scheduling the next step is scheduled before this one's ids are
        read, which a request that drafts from them cannot wait for; one whose text matched nothing lately
        skips a few proposals, so such steps may run ahead."""
        idle_wait_steps = 4 if lookahead else 0
        text = None
        if resolve.text_drafts(config.speculative_method) or not mtp:
            text = Drafter(
                config.num_speculative_tokens,
                idle_wait_steps=idle_wait_steps,
                vet=limit,
                sources=config.draft_sources,
            )
        if not mtp:
            assert text is not None
            return cls(text, counters)
        return cls(DraftChooser(text, config.num_mtp_tokens, limit), counters)

    def added(self, seq: Sequence) -> None:
        """Draft for a reply, unless it samples under a seed: its draws would depend on what the drafts were,
        so the seed would not reproduce it. Under a grammar or the loop guard, their limits cut each draft."""
        if seq.replies and (seq.params.greedy or seq.params.seed is None):
            self.drafter.add(seq.request_id, seq.prompt_token_ids, seq.cache_salt, seq.session_id)

    def needs_ids(self, request_id: str) -> bool:
        """The next draft follows the last token, unless the request's drafts are backing off (its next
        proposal is skipped unread)."""
        return not self.drafter.backing_off(request_id)

    def appended(self, seq: Sequence, token_ids: list[int], reason: FinishReason | None) -> Ending | None:
        """The drafter reads the reply's new tokens."""
        self.drafter.extend(seq.request_id, token_ids)
        return None

    def ended(self, request_id: str) -> None:
        """The reply stays a source for its head and session."""
        self.drafter.finish(request_id)

    def verified(self, request_id: str, num_drafted: int, num_accepted: int) -> None:
        """`num_accepted` of the request's `num_drafted` draft tokens were accepted: count them by source."""
        c = self.counters
        c.spec_verify_steps += 1
        c.spec_draft_tokens += num_drafted
        c.spec_accepted_tokens += num_accepted
        source = self.drafter.record(request_id, num_drafted, num_accepted)
        c.spec_accepted_sibling_tokens += num_accepted if source == "sibling" else 0
        c.spec_accepted_session_tokens += num_accepted if source == "session" else 0
        if source == "mtp":
            c.spec_mtp_draft_tokens += num_drafted
            c.spec_accepted_mtp_tokens += num_accepted
