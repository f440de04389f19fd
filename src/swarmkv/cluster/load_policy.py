"""The `balanced` routing decision: the cached prefix weighed against each replica's outstanding work, in tokens.

After SGLang's router (cache affinity until load is imbalanced past an absolute and a relative threshold) and
llm-d's scorer (prefix match and queue depth scored together); no code of either. A request's cost on a replica
is the work queued there plus the prefill it would add: its prompt less what that replica caches. A replica is
overloaded when its work exceeds the least loaded one's by both thresholds; it then takes no new swarm, and its
sessions move (counted). So a swarm's head is copied to a second replica on purpose, at the cost of one prefill,
rather than queue on one replica. A head shared very widely (a harness's, by every swarm running it) matches
on every replica holding it, and prefill cost alone lets those few take every new agent (SGLang's RFC names this
case): so a replica holding more sessions than the mean, past an absolute and a relative threshold, is crowded
and takes no new session, since an agent's later turns follow it there. Sessions are not equal work: one
harness's agents each bring a few thousand tokens of their own to prefill, another's a hundred, so replicas that
specialise by head are balanced in sessions and not in prefill. A replica whose prefill routed so far exceeds
the mean past an absolute and the same relative threshold is crowded too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

LoadReason = Literal["session", "prefix", "balance", "replicate", "moved"]


@dataclass(frozen=True)
class LoadThresholds:
    """When a replica counts as overloaded, and what a running sequence weighs."""

    overload_tokens: int = 4096  # absolute: work above the least loaded replica's, in tokens (two heads)
    overload_ratio: float = 1.5  # relative: work over the least loaded replica's
    running_tokens: int = 128  # a running sequence's weight: its decode steps share the replica with prefills
    crowded_sessions: int = 8  # absolute: sessions bound above the mean (a swarm's agents stay together)
    crowded_ratio: float = 1.1  # relative: sessions bound, or prefill tokens routed, over the mean
    # absolute: prefill tokens routed above the mean (about a harness's head)
    crowded_prefill_tokens: int = 8192

    def __post_init__(self) -> None:
        if (
            min(self.overload_tokens, self.running_tokens, self.crowded_sessions, self.crowded_prefill_tokens)
            < 0
            or min(self.overload_ratio, self.crowded_ratio) < 1.0
        ):
            raise ValueError(
                f"overload_tokens, running_tokens, crowded_sessions and crowded_prefill_tokens must be >= 0 and"
                f" overload_ratio and crowded_ratio >= 1, got {self.overload_tokens}, {self.running_tokens},"
                f" {self.crowded_sessions}, {self.crowded_prefill_tokens}, {self.overload_ratio} and"
                f" {self.crowded_ratio}"
            )

    def overloaded(self, work_tokens: float, least_work_tokens: float) -> bool:
        """Whether a replica with `work_tokens` outstanding is past both thresholds over the least loaded."""
        return (
            work_tokens - least_work_tokens > self.overload_tokens
            and work_tokens > self.overload_ratio * least_work_tokens
        )

    def crowded(
        self,
        sessions: int,
        mean_sessions: float,
        prefill_tokens: float = 0.0,
        mean_prefill_tokens: float = 0.0,
    ) -> bool:
        """Whether a replica with `sessions` bound, or `prefill_tokens` routed, is past both thresholds over the
        mean: it takes no new session."""
        return (
            sessions - mean_sessions > self.crowded_sessions and sessions > self.crowded_ratio * mean_sessions
        ) or (
            prefill_tokens - mean_prefill_tokens > self.crowded_prefill_tokens
            and prefill_tokens > self.crowded_ratio * mean_prefill_tokens
        )


@dataclass(frozen=True)
class Candidate:
    """One replica as the decision sees it."""

    replica: str
    work_tokens: float  # queued prefill tokens plus running sequences at `running_tokens` each
    matched_tokens: int  # of this prompt, in the router's index of the replica (0 below the least match)
    routed: int  # requests routed there so far: breaks ties between equally loaded replicas
    sessions: int = 0  # sessions bound there: each brings its later turns
    prefill_tokens: float = 0.0  # prefill routed there so far: each prompt less what the router matched there


def pick(
    candidates: Sequence[Candidate],
    num_prompt_tokens: int,
    home: str | None,
    thresholds: LoadThresholds,
    new_session: bool = False,
) -> tuple[str, LoadReason]:
    """The replica for a prompt of `num_prompt_tokens` whose session's KV is on `home` (None: nowhere), and why;
    `new_session`: the request starts a session here, so crowded replicas are passed over."""
    if not candidates:
        raise ValueError("no replica to route to")
    least = min(c.work_tokens for c in candidates)
    by_id = {c.replica: c for c in candidates}
    at_home = by_id.get(home) if home is not None else None
    holds_session = at_home is not None and at_home.matched_tokens > 0
    if at_home is not None and holds_session and not thresholds.overloaded(at_home.work_tokens, least):
        return at_home.replica, "session"
    # The least loaded replica is never overloaded, so `open_` is never empty.
    open_ = [c for c in candidates if not thresholds.overloaded(c.work_tokens, least)]
    if new_session or (home is not None and not holds_session):
        # A widely shared head matches everywhere it is cached, and prefill load alone lets the replicas
        # holding it take every new agent. An agent's later turns follow it, so its session is load to come.
        mean = sum(c.sessions for c in candidates) / len(candidates)
        mean_prefill = sum(c.prefill_tokens for c in candidates) / len(candidates)
        open_ = [
            c for c in open_ if not thresholds.crowded(c.sessions, mean, c.prefill_tokens, mean_prefill)
        ] or open_
    best = min(
        open_, key=lambda c: (c.work_tokens + num_prompt_tokens - c.matched_tokens, c.routed, c.replica)
    )
    if holds_session:
        return best.replica, "moved"
    if best.matched_tokens < max(c.matched_tokens for c in candidates):
        return best.replica, "replicate"  # a replica holding more of the prefix was too busy: copy it here
    return best.replica, "prefix" if best.matched_tokens > 0 else "balance"
