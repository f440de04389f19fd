"""The pins whose one-token prefill is still queued or running, and the futures their HTTP callers await.

Loop thread only. A pin reaches the engine as an ordinary request under its pin id; its finished delta
means the engine now holds the prefix's pages under the pin, so its caller gets `get_pin()`. A pin the
engine holds at once (a hybrid's prefix cached with its state snapshot) is answered at once.
"""

from __future__ import annotations

import concurrent.futures
import logging

from swarmkv.core.pins import PinInfo
from swarmkv.engine.engine import LLMEngine, RequestDelta
from swarmkv.server.engine_loop.commands import AddPin
from swarmkv.server.engine_loop.request_stream import EngineStepError

log = logging.getLogger(__name__)


class PendingPins:
    """Pin id -> the future of the caller waiting for that pin to be ready."""

    def __init__(self) -> None:
        self._ready: dict[str, concurrent.futures.Future[PinInfo | None]] = {}

    def __contains__(self, pin_id: str) -> bool:
        return pin_id in self._ready

    def add(self, engine: LLMEngine, command: AddPin) -> None:
        """Queue the pin's prefill; the engine's refusal (bad TTL, over the cap) goes to the caller now."""
        if not command.ready.set_running_or_notify_cancel():
            return  # the caller was cancelled before the engine saw the pin
        try:
            held = engine.add_pin(command.pin_id, command.prompt_token_ids, command.ttl_s, command.cache_salt)
        except Exception as exc:
            command.ready.set_exception(exc)
            return
        if held:  # cached already (a hybrid's prefix with its state): no prefill, no delta to wait for
            command.ready.set_result(engine.get_pin(command.pin_id))
            return
        self._ready[command.pin_id] = command.ready

    def after(self, pin_id: str, ready: concurrent.futures.Future[PinInfo | None]) -> None:
        """Resolve `ready` with None (nothing computed for its caller) once the pin's prefill in flight
        ends, however it ends, or at once when none is."""
        pending = self._ready.get(pin_id)
        if pending is None:
            ready.set_result(None)
        else:
            pending.add_done_callback(lambda _: ready.set_result(None))

    def settle(self, engine: LLMEngine, delta: RequestDelta) -> None:
        """Hand the caller its pin once the prefill's finished delta arrives (its one token is dropped)."""
        if not delta.finished:
            return
        ready = self._ready.pop(delta.request_id)
        if delta.error is not None:
            ready.set_exception(EngineStepError(delta.error))
        else:
            ready.set_result(engine.get_pin(delta.request_id))

    def unpin(self, engine: LLMEngine, pin_id: str) -> bool:
        """Unpin, stopping a prefill still in flight (its caller then gets None); False if unknown."""
        ready = self._ready.pop(pin_id, None)
        if ready is not None:
            ready.set_result(None)
        return engine.unpin(pin_id)  # the engine's unpin also aborts a prefill in flight

    def fail_all(self, engine: LLMEngine, error: Exception) -> None:
        """Drop every pin still in flight and hand its caller `error`."""
        for pin_id, ready in list(self._ready.items()):
            del self._ready[pin_id]
            ready.set_exception(error)
            try:
                engine.unpin(pin_id)
            except Exception:
                log.exception("dropping the pin %s failed", pin_id)
