"""SamplingParams: how one request picks its tokens and when it stops, validated once at construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from swarmkv.errors import InvalidRequestError

GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; temperature 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # An llguidance grammar (`swarmkv.structured.grammars`) the reply must follow; None: unconstrained.
    grammar: str | None = None
    grammar_prefix: str = ""  # text of the grammar the prompt already ends with (a forced call's opening)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        # NaN fails every comparison, so this range check refuses it too.
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k <= 0):
            raise InvalidRequestError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]
        ):
            raise InvalidRequestError(f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise InvalidRequestError("stop must be non-empty strings")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            raise InvalidRequestError("grammar must be a non-empty grammar text or None")

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen by argmax (temperatures this small would overflow the logits)."""
        return self.temperature < GREEDY_BELOW

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> SamplingParams:
        """Build from a plain dict, refusing unknown fields with an InvalidRequestError."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling field(s): {', '.join(unknown)}")
        return cls(**fields)


def _is_real(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
