"""The long swarm without the model: every reply as one run generated it, so policies compare in seconds.

Greedy decoding on a float32 model gives the same transcript under every retention policy (the long report checks
it), so once one run has recorded each turn's token ids, another run can take them instead of running the model.
`ReplayExecutor` stands in for the engine's executor: each sampling chunk's next token is the recorded one (a
draft is accepted as far as it matches the record, as exact verification would). Everything else is the engine's
own: the scheduler, the KV manager and its retention, the output processor. Under the modelled clock a replay
takes the same steps as the run it recorded, so its counters are that run's.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Sequence
from typing import Any

from swarmkv.core.scheduler import StepPlan
from swarmkv.engine.executor import RowOutput, StepOutput
from swarmkv.engine.lookahead import ProvisionalInputs
from swarmkv.tokenizer import Tokenizer

# `--replay-replies fixed`: every reply this text, repeated to max_tokens (a quick look without a recorded run).
FIXED = "fixed"
FIXED_REPLY = " I will look at the next file and fix the failing test now, then"
# The run settings a record must share with the run that replays it.
_KEYS = ("agents", "turns", "seed", "max_tokens", "max_model_len", "prefix_tokens", "subagent_share")


class ReplayExecutor:
    """Each sampling chunk's tokens from `replies` (request id -> the token ids its run generated)."""

    def __init__(self, replies: dict[str, list[int]]) -> None:
        self.replies = replies

    def execute(self, plan: StepPlan, provisional: ProvisionalInputs | None) -> StepOutput:
        """The recorded tokens of every chunk that samples: a draft's matching prefix, then one more."""
        assert provisional is None, "a replay schedules no step ahead"
        rows = []
        for chunk in plan.chunks:
            if not chunk.samples:
                continue
            seq = chunk.seq
            recorded = self.replies[seq.request_id][len(seq.output_token_ids) :]
            if not recorded:
                raise RuntimeError(f"{seq.request_id} asks for more tokens than its run generated")
            accepted = 0
            while accepted < len(chunk.draft) and accepted + 1 < len(recorded):
                if chunk.draft[accepted] != recorded[accepted]:
                    break
                accepted += 1
            rows.append(RowOutput(chunk, recorded[: accepted + 1]))
        return StepOutput(rows)


def record_of(
    settings: dict[str, Any], session_ids: Sequence[str], token_ids: list[list[list[int]]]
) -> dict[str, Any]:
    """The JSON a replay reads: the run's settings and each request's generated ids, by request id."""
    replies = {
        f"{session}/turn-{turn}": ids
        for session, turns in zip(session_ids, token_ids, strict=True)
        for turn, ids in enumerate(turns)
    }
    return {"settings": {key: settings[key] for key in _KEYS}, "replies": replies}


def fixed_replies(tokenizer: Tokenizer, max_tokens: int) -> dict[str, list[int]]:
    """Every request's reply: FIXED_REPLY's tokens, repeated to `max_tokens`."""
    ids = tokenizer.encode(FIXED_REPLY)
    reply = (ids * (max_tokens // len(ids) + 1))[:max_tokens]
    return collections.defaultdict(lambda: list(reply))


def load_replies(path: str, settings: dict[str, Any]) -> dict[str, list[int]]:
    """The replies recorded at `path`; ValueError if they were recorded under other settings."""
    with open(path) as f:
        data = json.load(f)
    recorded = data["settings"]
    differ = [key for key in _KEYS if recorded.get(key) != settings[key]]
    if differ:
        raise ValueError(
            f"{path} was recorded with other settings ({', '.join(f'{k}={recorded.get(k)!r}' for k in differ)}): "
            "record it again with these"
        )
    replies: dict[str, list[int]] = data["replies"]
    return replies
