"""Sequence: one request's tokens, sampling settings and progress counters; its pages are the KV manager's."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.stats import EngineCounters

FinishReason = Literal["stop", "length", "abort", "error"]

# The id held in place of a token sampled on the device and not yet read back (async scheduling). It never
# reaches a model: the runner takes the device's sampled id in its place, and an id outside the vocabulary
# fails loudly if one slips through.
PROVISIONAL_TOKEN = -1


class Status(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A request in flight: `num_computed_tokens` of its tokens have KV in the pages the KV manager keeps
    under its `request_id`."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    arrival: int = 0
    session_id: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    num_processed_tokens: int = 0  # high-water mark of positions ever computed or served from cache
    num_preemptions: int = 0
    num_starved_steps: int = 0  # consecutive steps it waited for prefill compute and got none
    waited_for_prefix: bool = False  # it waited for another request's prefill of its head, not yet admitted
    branch_tokens: int = 0  # hybrids: tokens the cached pages matched at admission (a branch point)
    snapshot_tokens: int = 0  # hybrids: where the turn snapshot it resumed from (its previous turn) ends
    num_provisional_tokens: int = 0  # trailing tokens still on the device (0 or 1): PROVISIONAL_TOKEN here
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None

    _token_ids: list[int] = field(default_factory=list, repr=False)  # prompt + output, kept in step
    _page_keys: list[tuple[int, ...]] = field(default_factory=list, repr=False)  # of its full pages so far

    # Whether its generated tokens are a reply someone reads (drafted, guarded, counted); a kind of request
    # that only computes KV says no.
    replies: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self._token_ids = self.prompt_token_ids + self.output_token_ids

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by generated tokens (the sequence's own list: read it, do not change it)."""
        return self._token_ids

    def page_keys(self, page_size: int) -> list[tuple[int, ...]]:
        """The prefix index's keys of its full pages (their tokens), each built once: tokens only grow, and
        one engine has one page size. Read it, do not change it."""
        keys, tokens = self._page_keys, self._token_ids
        # A provisional token is not the page's content yet: its page gets a key once it is settled.
        while (len(keys) + 1) * page_size <= len(tokens) - self.num_provisional_tokens:
            start = len(keys) * page_size
            keys.append(tuple(tokens[start : start + page_size]))
        return keys

    def append_token(self, token: int) -> None:
        """Add a generated token."""
        self.output_token_ids.append(token)
        self._token_ids.append(token)

    def append_provisional(self) -> None:
        """Add a token sampled on the device whose id is not read back yet (the next step may compute it)."""
        assert self.num_provisional_tokens == 0, "one step of lookahead at most"
        self.append_token(PROVISIONAL_TOKEN)
        self.num_provisional_tokens = 1

    def drop_provisional(self) -> None:
        """Take the provisional token back, before its real id is appended in its place."""
        assert self.num_provisional_tokens == 1 and self._token_ids[-1] == PROVISIONAL_TOKEN
        self.output_token_ids.pop()
        self._token_ids.pop()
        self.num_provisional_tokens = 0

    def take_back(self, num_tokens: int) -> None:
        """Remove the reply's last `num_tokens` tokens, appended by this step and not yet counted as computed (a
        stop string ended the reply before them)."""
        assert self.num_provisional_tokens == 0 and 0 <= num_tokens <= len(self.output_token_ids)
        assert self.num_computed_tokens <= len(self._token_ids) - num_tokens, "their KV already counts"
        del self.output_token_ids[len(self.output_token_ids) - num_tokens :]
        del self._token_ids[len(self._token_ids) - num_tokens :]

    def reached_length(self, max_model_len: int | None) -> bool:
        """Whether the reply is as long as it may get: max_tokens, or the context's `max_model_len` positions."""
        return len(self.output_token_ids) >= self.params.max_tokens or (
            max_model_len is not None and self.num_tokens >= max_model_len
        )

    def count_hit(self, counters: EngineCounters, num_tokens: int) -> None:
        """Count `num_tokens` prompt positions found in the prefix cache for the first time."""
        counters.prefix_hit_tokens += num_tokens
        counters.prompt_tokens += num_tokens

    def count_work(self, counters: EngineCounters, num_recomputed: int, num_first_prompt: int) -> None:
        """Count positions computed again and prompt positions computed for the first time."""
        counters.recomputed_tokens += num_recomputed
        counters.prompt_tokens += num_first_prompt
        counters.prefill_tokens_computed += num_recomputed + num_first_prompt

    def count_generated(self, counters: EngineCounters, num_tokens: int) -> None:
        """Count tokens appended to the reply."""
        counters.generated_tokens += num_tokens

    def ended(self) -> None:
        """The request finished, failed or was aborted, and is forgotten: what its kind does then."""

    @property
    def num_settled_output_tokens(self) -> int:
        """The reply's tokens whose ids are known: all but a provisional last one."""
        return len(self.output_token_ids) - self.num_provisional_tokens

    @property
    def settled_output_token_ids(self) -> list[int]:
        """Those tokens (a copy)."""
        return self.output_token_ids[: self.num_settled_output_tokens]

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not in the page table yet (1 while decoding)."""
        return self.num_tokens - self.num_computed_tokens
