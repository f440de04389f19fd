"""Turns the engine core's tokens into text deltas: detokenizing, stop strings, stream holdback, finish reasons.

The core decides token-level endings (an end-of-turn id, max_tokens, the context limit); this module adds
the text-level one, a stop string, which can only be seen after detokenizing. Streamed text never has to be
retracted: a suffix that could still grow into a stop string is held back until it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

from swarmkv.core.processors import Ending, RequestProcessor
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.sequence import FinishReason, Sequence
from swarmkv.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class RequestDelta:
    """What one request produced in one step; `error` is set when the step failed it."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None
    error: str | None = None
    stop_string: str | None = None  # the stop string that finished the request, if one did
    # Where each new token's text ends in the reply's text, when the step appended several: () for one.
    token_text_ends: tuple[int, ...] = ()


@dataclass
class _TextState:
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_text_emitted: int = 0
    num_text_checked: int = 0  # text before this offset holds no stop string


class OutputProcessor(RequestProcessor):
    """Per-request text state, from `add` to the delta that finishes the request; as a processor, each
    `EngineCore.update` makes one delta (`take` it), and a stop string ends the reply."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _TextState] = {}
        self._deltas: dict[str, RequestDelta] = {}

    def added(self, seq: Sequence) -> None:
        """Track the request's text."""
        self.add(seq.request_id, seq.prompt_token_ids, seq.params)

    def appended(self, seq: Sequence, token_ids: list[int], reason: FinishReason | None) -> Ending | None:
        """The update's delta; an Ending where a stop string ends the reply inside `token_ids`."""
        delta = self.process(seq.request_id, seq.output_token_ids, token_ids, reason)
        self._deltas[seq.request_id] = delta
        if delta.finish_reason == reason and len(delta.new_token_ids) == len(token_ids):
            return None
        assert delta.finish_reason is not None
        return Ending(len(delta.new_token_ids), delta.finish_reason)

    def take(self, request_id: str) -> RequestDelta:
        """The delta of the request's latest update."""
        return self._deltas.pop(request_id)

    def ended(self, request_id: str) -> None:
        """Forget the request (its text ends without a delta if it was aborted)."""
        self.drop(request_id)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Start tracking a request's text."""
        self._states[request_id] = _TextState(
            params, IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
        )

    def process(
        self,
        request_id: str,
        output_token_ids: list[int],
        new_token_ids: list[int],
        reason: FinishReason | None,
    ) -> RequestDelta:
        """Detokenize the request's new tokens; a stop string in the text finishes it with "stop" and cuts
        the text before it. `reason` is the core's finish reason, None while the request goes on. Where several
        tokens came at once (an accepted draft, a forced run), the delta keeps those up to the one that completed
        the stop string, as one token a step would have: the caller takes the rest back."""
        state = self._states[request_id]
        ends: list[int] = []
        base = len(output_token_ids) - len(new_token_ids)
        for i in range(1, len(new_token_ids) + 1):  # token by token: where each token's text ends
            state.text += state.detokenizer.step(output_token_ids, base + i)
            ends.append(len(state.text))
        if reason is not None:
            state.text += state.detokenizer.flush(output_token_ids)
        if ends:
            ends[-1] = len(state.text)  # the last token holds what the flush released
        kept = new_token_ids
        found = self._scan_for_stop_string(state)
        stop_string = None
        if found is not None:
            at, stop_string = found
            reason = "stop"
            # Text checked before held no stop string, so one of the new tokens completed it.
            done = next((i for i, end in enumerate(ends) if end >= at + len(stop_string)), len(ends) - 1)
            kept, ends = new_token_ids[: done + 1], ends[: done + 1]
            state.text = state.text[:at]
        # For one token its text is the delta's; a stop string may have cut the text.
        token_text_ends = tuple(min(end, len(state.text)) for end in ends) if len(ends) > 1 else ()
        return self._delta(request_id, state, kept, reason, stop_string, token_text_ends)

    def fail(self, request_id: str, error: str) -> RequestDelta:
        """The request ended in a failed step: no more text, the error instead."""
        self._states.pop(request_id, None)
        return RequestDelta(request_id, [], "", True, "error", error)

    def drop(self, request_id: str) -> None:
        """Forget an aborted request."""
        self._states.pop(request_id, None)

    def _scan_for_stop_string(self, state: _TextState) -> tuple[int, str] | None:
        """Where the first stop string in the text not scanned before starts, and which it is; None if none is
        there. Marks the text scanned: the next call looks only at what is added after it."""
        stops = state.params.stop
        if not stops:
            return None
        # A stop string may straddle the checked text and the new piece: back up by the longest one.
        start = max(0, state.num_text_checked - max(len(s) for s in stops) + 1)
        state.num_text_checked = len(state.text)
        hits = [(i, s) for s in stops if (i := state.text.find(s, start)) >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else None

    def _delta(
        self,
        request_id: str,
        state: _TextState,
        tokens: list[int],
        reason: FinishReason | None,
        stop_string: str | None,
        token_text_ends: tuple[int, ...] = (),
    ) -> RequestDelta:
        finished = reason is not None
        # Hold back a possible stop-string prefix until the request finishes, so streamed text is never retracted.
        holdback = 0 if finished else max((len(s) - 1 for s in state.params.stop), default=0)
        upto = max(state.num_text_emitted, len(state.text) - holdback)
        new_text = state.text[state.num_text_emitted : upto]
        state.num_text_emitted = upto
        if finished:
            del self._states[request_id]
        return RequestDelta(
            request_id,
            tokens,
            new_text,
            finished,
            reason,
            stop_string=stop_string,
            token_text_ends=token_text_ends,
        )
