"""AsyncEngine: one background thread owns the LLMEngine; asyncio code submits, streams, pins and aborts.

The engine is not thread-safe, so every call into it (add, step, abort, stats, integrity checks) runs on
the loop thread. Other threads only put commands on a queue; the loop thread applies them between steps
and hands each request's outputs to that request's asyncio queue with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from swarmkv.core.pins import PinInfo
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.core.sequence import Sequence
from swarmkv.core.stats import EngineStats
from swarmkv.engine.engine import LLMEngine, RequestDelta
from swarmkv.errors import InvalidRequestError
from swarmkv.server.engine_loop.commands import (
    Abort,
    Add,
    AddPin,
    Call,
    Command,
    DropPin,
    RequestPin,
    Stop,
    fail_unapplied,
)
from swarmkv.server.engine_loop.pending_pins import PendingPins
from swarmkv.server.engine_loop.request_stream import (
    EngineStepError,
    EngineUnavailableError,
    OnEnd,
    RequestStream,
    step_output,
)

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class _Live:
    stream: RequestStream
    seq: Sequence


class AsyncEngine:
    """Runs an LLMEngine on its own thread; every public method may be called from any thread."""

    def __init__(self, engine: LLMEngine, max_step_s: float | None = None) -> None:
        """`max_step_s`: the longest a step should take (`ServerConfig.max_step_s`), as aborts wait for the
        step running; None: the engine's token budget alone."""
        self.engine = engine
        engine.core.scheduler.cap_step_time(max_step_s)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._live: dict[str, _Live] = {}
        self._pins = PendingPins()
        self._thread: threading.Thread | None = None
        self._snapshot: EngineStats = engine.snapshot()
        self._num_aborted = 0
        # Guards `_closed` so that no command is queued after the loop's final drain.
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> None:
        """Start the loop thread."""
        assert self._thread is None, "the engine loop is already running"
        self._thread = threading.Thread(target=self._run, name="swarmkv-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; requests still in flight end with EngineUnavailableError."""
        if self._thread is None:
            return
        with contextlib.suppress(EngineUnavailableError):  # the loop may have closed already
            self._put(Stop())
        self._thread.join(timeout_s)
        self._thread = None

    def _put(self, command: Command) -> None:
        with self._lock:
            if self._closed or self._thread is None:
                raise EngineUnavailableError("the engine is not running")
            self._commands.put(command)

    @property
    def is_running(self) -> bool:
        """Whether the loop thread is alive."""
        return self._thread is not None and self._thread.is_alive()

    async def submit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        arrival_s: float | None = None,
        session_id: str | None = None,
        pins: tuple[RequestPin, ...] = (),
        on_end: OnEnd | None = None,
    ) -> RequestStream:
        """Queue a request with its `pins`, one command; returns once the engine accepted it (its stream's
        `num_pin_created_tokens` says what the pins computed), or raises its InvalidRequestError. `on_end` is
        called with the stream and its last output when its consumer reads it."""
        arrival = time.perf_counter() if arrival_s is None else arrival_s
        stream = RequestStream(request_id, arrival, on_end)
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._put(Add(stream, prompt_token_ids, params, cache_salt, session_id, accepted, pins))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(request_id)  # the client left before admission: nobody will read the stream
            raise
        return stream

    async def pin(
        self, pin_id: str, prompt_token_ids: list[int], ttl_s: float | None, cache_salt: str | None = None
    ) -> PinInfo | None:
        """Pin a prefix: returns once its prefill finished and the engine holds it (None: already gone).

        Raises the engine's InvalidRequestError (PinLimitError over the cap) when it refuses the pin, and
        EngineStepError when the step computing it fails. If the caller is cancelled, the pin is dropped.
        """
        ready: concurrent.futures.Future[PinInfo | None] = concurrent.futures.Future()
        self._put(AddPin(pin_id, prompt_token_ids, ttl_s, cache_salt, ready))
        try:
            return await asyncio.wrap_future(ready)
        except asyncio.CancelledError:
            # Its client left: nobody will learn the pin's id to unpin it.
            with contextlib.suppress(EngineUnavailableError):  # a stopped engine holds no pins
                self._put(DropPin(pin_id))
            raise

    async def unpin(self, pin_id: str) -> bool:
        """Unpin (a pin still being computed is stopped, and its creator told so); False if unknown."""
        return await asyncio.wrap_future(self.call(lambda engine: self._pins.unpin(engine, pin_id)))

    def abort(self, request_id: str) -> None:
        """Stop a request and release its pages; a no-op once it has finished."""
        with contextlib.suppress(EngineUnavailableError):  # a stopped engine holds no requests
            self._put(Abort(request_id))

    def call(self, fn: Callable[[LLMEngine], T]) -> concurrent.futures.Future[T]:
        """Run `fn(engine)` on the loop thread between steps (stats, integrity checks)."""
        result: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            self._put(Call(fn, result))
        except EngineUnavailableError as exc:
            result.set_exception(exc)
        return result

    @property
    def last_step_error(self) -> str | None:
        """Why the engine's latest step failed; None while steps succeed."""
        return self.engine.last_step_error  # one attribute read: safe from any thread

    @property
    def num_aborted(self) -> int:
        """Requests aborted (their client went away) since the loop started."""
        return self._num_aborted

    def snapshot(self) -> EngineStats:
        """The engine's stats as of its latest step or command (immutable: safe from any thread)."""
        return self._snapshot

    def stats(self) -> dict[str, Any]:
        """`snapshot()` as a flat dict, plus `requests_aborted`."""
        return {**self._snapshot.to_dict(), "requests_aborted": self._num_aborted}

    # Everything below runs on the loop thread only.

    def _run(self) -> None:
        running = True
        while running:
            try:
                running = self._iterate()
            except Exception:
                # An engine bug: fail what is in flight rather than leave its clients waiting forever.
                log.exception("the engine loop failed; failing every request in flight")
                self._fail_all(EngineUnavailableError("the engine failed while running this request"))

    def _iterate(self) -> bool:
        """Apply queued commands, then run one step if there is work; False once told to stop."""
        commands = self._next_commands(block=not self.engine.has_unfinished())
        for i, command in enumerate(commands):
            if isinstance(command, Stop):
                self._close(EngineUnavailableError("the server is shutting down"), commands[i + 1 :])
                return False
            self._apply(command)
        if self.engine.has_unfinished():
            deltas = self.engine.step()
            now = time.perf_counter()
            for delta in deltas:
                self._dispatch(delta, now)
        self._snapshot = self.engine.snapshot()
        return True

    def _next_commands(self, block: bool) -> list[Command]:
        commands: list[Command] = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: Command) -> None:
        if isinstance(command, Add):
            self._pin_then_admit(command, list(command.pins))
        elif isinstance(command, AddPin):
            self._pins.add(self.engine, command)
        elif isinstance(command, DropPin):
            self._pins.unpin(self.engine, command.pin_id)
        elif isinstance(command, Abort):
            if self._live.pop(command.request_id, None) is not None and self.engine.abort(command.request_id):
                self._num_aborted += 1
        elif isinstance(command, Call) and command.result.set_running_or_notify_cancel():
            try:
                command.result.set_result(command.fn(self.engine))
            except Exception as exc:
                command.result.set_exception(exc)

    def _pin_then_admit(self, command: Add, pins: list[RequestPin]) -> None:
        """Pin the request's next pin, and on its prefill's end the one after it; admit the request last.
        Runs on the loop thread: a pin's future is resolved there, which runs its callback."""
        if not pins:
            self._admit(command)
            return
        pin, rest = pins[0], pins[1:]
        ready: concurrent.futures.Future[PinInfo | None] = concurrent.futures.Future()
        pinned_already = self.engine.core.pins
        if pin.pin_id in pinned_already:
            # The same prefix under the same salt, pinned by an earlier request (a repeat, or another agent
            # at the same moment): share that pin, and wait for its prefill if it is still running, so this
            # request reads the prefix instead of computing it beside it.
            pinned_already.share(pin.pin_id, pin.ttl_s)
            self._pins.after(pin.pin_id, ready)
        else:
            self._add_request_pin(command, pin, ready)

        def pinned(done: concurrent.futures.Future[PinInfo | None]) -> None:
            error = done.exception()
            if isinstance(error, InvalidRequestError):  # over --max-pinned-memory: answer it unpinned
                tenant = pin.share[0] if pin.share is not None else None  # None: a single tenant
                log.info(
                    "cache_control prefix of %d tokens not pinned (tenant %s): %s",
                    len(pin.prompt_token_ids),
                    tenant,
                    error,
                )
            elif error is not None:  # the engine failed or is stopping: so does the request
                if command.accepted.set_running_or_notify_cancel():
                    command.accepted.set_exception(error)
                return
            info = None if error is not None else done.result()
            command.stream.num_pin_created_tokens += 0 if info is None else info.num_created_tokens
            self._pin_then_admit(command, rest)

        ready.add_done_callback(pinned)

    def _add_request_pin(
        self, command: Add, pin: RequestPin, ready: concurrent.futures.Future[PinInfo | None]
    ) -> None:
        """Pin a request's prefix anew, within its tenant's share of the pinned memory where tenants share it;
        `ready` holds the refusal."""
        try:
            if pin.share is not None:
                group, num_tenants = pin.share
                share_bytes = self.engine.core.pins.max_bytes // num_tenants
                self.engine.core.pins.check_share(group, len(pin.prompt_token_ids), share_bytes)
        except InvalidRequestError as exc:
            ready.set_exception(exc)
        else:
            self._pins.add(
                self.engine, AddPin(pin.pin_id, pin.prompt_token_ids, pin.ttl_s, command.cache_salt, ready)
            )

    def _admit(self, command: Add) -> None:
        """Admit the request, its pins held: from here its deltas go to its stream."""
        rid = command.stream.request_id
        if not command.accepted.set_running_or_notify_cancel():
            return  # the submitter was cancelled before the engine saw the request
        try:
            self.engine.add_request(
                rid,
                command.prompt_token_ids,
                command.params,
                command.cache_salt,
                session_id=command.session_id,
            )
        except Exception as exc:
            command.accepted.set_exception(exc)
            return
        seq = self.engine.get_sequence(rid)
        assert seq is not None
        self._live[rid] = _Live(command.stream, seq)
        command.accepted.set_result(None)

    def _dispatch(self, delta: RequestDelta, now: float) -> None:
        if delta.request_id in self._pins:
            self._pins.settle(self.engine, delta)
            return
        live = self._live.get(delta.request_id)
        if live is None:
            return
        if delta.error is not None:
            del self._live[delta.request_id]
            with contextlib.suppress(RuntimeError):  # the stream's event loop has closed
                live.stream.put(EngineStepError(delta.error))
            return
        output = step_output(delta, live.seq, now)
        if delta.finished:
            del self._live[delta.request_id]
        try:
            live.stream.put(output)
        except RuntimeError:  # the stream's event loop has closed: nobody is listening
            if not delta.finished:
                self._live.pop(delta.request_id, None)
                self.engine.abort(delta.request_id)

    def _fail_all(self, error: Exception) -> None:
        self._pins.fail_all(self.engine, error)
        for rid, live in list(self._live.items()):
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
            with contextlib.suppress(RuntimeError):  # the stream's event loop has closed
                live.stream.put(error)
        self._live.clear()

    def _close(self, error: Exception, pending: list[Command]) -> None:
        with self._lock:
            self._closed = True
        self._fail_all(error)
        # Commands taken from the queue but not applied, and those still queued, would wait forever.
        fail_unapplied(pending + self._next_commands(block=False), error)
