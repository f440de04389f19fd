"""StepOutput: what one engine step produced for one request, the input of every protocol's answer objects."""

from __future__ import annotations

from dataclasses import dataclass

from swarmkv.core.sequence import FinishReason


@dataclass(frozen=True)
class StepOutput:
    """What one engine step produced for one request, with the request's running totals."""

    text: str
    num_new_tokens: int
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens the prefix cache served at admission
    num_output_tokens: int
    emitted_at_s: float  # time.perf_counter() on the loop thread
    stop_string: str | None = None  # the stop string that finished the request, if one did
    # Where each new token's text ends in the reply's text, for an output of several tokens (a draft's, a
    # forced run's); () for one token.
    token_text_ends: tuple[int, ...] = ()
