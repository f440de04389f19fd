"""SamplingParams: how one request picks its tokens and when it stops, validated once at construction."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from swarmkv.errors import InvalidRequestError

GREEDY_BELOW = 1e-5
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's presence and frequency penalties
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's logit_bias values


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings; temperature 0 means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0  # tokens below min_p x the top token's probability are dropped (after temperature)
    # OpenAI's, as vLLM applies them: subtracted from a token's logit once it is in the reply (presence), and
    # once for each time it is (frequency); repetition divides a positive logit of a token in the prompt or
    # the reply, and multiplies a negative one.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids ascending
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
        raw: Any = self.logit_bias  # a dict is taken too
        bias = dict(raw.items() if isinstance(raw, dict) else raw)
        object.__setattr__(self, "logit_bias", tuple(sorted(bias.items())))
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        # NaN fails every comparison, so this range check refuses it too.
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k <= 0):
            raise InvalidRequestError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not PENALTY_RANGE[0] <= value <= PENALTY_RANGE[1]:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value!r}")
        rep = self.repetition_penalty
        if not _is_real(rep) or not math.isfinite(rep) or rep <= 0:
            raise InvalidRequestError(f"repetition_penalty must be a finite number > 0, got {rep!r}")
        for token, value in self.logit_bias:
            if not _is_int(token) or token < 0:
                raise InvalidRequestError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not _is_real(value) or not LOGIT_BIAS_RANGE[0] <= value <= LOGIT_BIAS_RANGE[1]:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {value!r}")
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

    @property
    def penalised(self) -> bool:
        """Whether a presence, frequency or repetition penalty follows the tokens so far."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits change before any token is picked (a bias or a penalty)."""
        return bool(self.logit_bias) or self.penalised

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
