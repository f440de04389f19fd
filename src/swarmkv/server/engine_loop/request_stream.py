"""What a request's consumer sees: a stream of per-step outputs, fed from the engine's loop thread."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from swarmkv.api.outputs import StepOutput
from swarmkv.core.sequence import Sequence
from swarmkv.engine.engine import RequestDelta
from swarmkv.errors import SwarmkvError


class EngineUnavailableError(SwarmkvError):
    """The engine loop stopped (shutdown) or failed while the request was in flight."""

    status = 503


class EngineStepError(EngineUnavailableError):
    """The engine step computing this request failed; the engine itself goes on serving."""

    status = 500


def step_output(delta: RequestDelta, seq: Sequence, now_s: float) -> StepOutput:
    """What the request's consumer sees of one engine delta, with the sequence's totals after it."""
    return StepOutput(
        text=delta.new_text,
        num_new_tokens=len(delta.new_token_ids),
        finished=delta.finished,
        finish_reason=delta.finish_reason,
        num_prompt_tokens=len(seq.prompt_token_ids),
        num_cached_tokens=seq.num_cached_tokens,
        num_output_tokens=seq.num_settled_output_tokens,
        emitted_at_s=now_s,
        stop_string=delta.stop_string,
        token_text_ends=delta.token_text_ends,
    )


OnEnd = Callable[["RequestStream", StepOutput], None]


class RequestStream:
    """The outputs of one request, in order; iterate with `async for`."""

    def __init__(self, request_id: str, arrival_s: float, on_end: OnEnd | None = None) -> None:
        self.request_id = request_id
        self.arrival_s = arrival_s
        self._on_end = on_end  # called with the stream and its last output once its consumer reads it
        self._queue: asyncio.Queue[StepOutput | Exception] = asyncio.Queue()
        self.loop = asyncio.get_running_loop()
        self.finished = False
        # Prompt tokens the request's own pins computed before it was admitted (set by the loop thread).
        self.num_pin_created_tokens = 0

    def put(self, item: StepOutput | Exception) -> None:
        """Hand an item over from any thread."""
        self.loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StepOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, Exception):
            self.finished = True
            raise item
        self.finished = item.finished
        if item.finished and self._on_end is not None:
            self._on_end(self, item)
        return item
