"""The commands other threads queue for the engine loop thread, which applies them between steps."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from swarmkv.core.pins import PinInfo
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.engine.engine import LLMEngine
from swarmkv.server.engine_loop.request_stream import RequestStream


@dataclass(frozen=True)
class RequestPin:
    """A prefix its request pins before it is admitted (a Messages cache mark), under an id that follows from
    the prefix and salt, so a repeat, or another request at the same moment, shares the pin (`Pins.share`)
    instead of adding one."""

    pin_id: str
    prompt_token_ids: list[int]
    ttl_s: float | None
    # The tenant and the number of tenants sharing max_pinned_memory, when its share is checked first.
    share: tuple[str, int] | None = None


@dataclass
class Add:
    """Admit a request, after pinning its `pins` one by one (each prefill finished before the next, and
    before the request, so each reads what the one before it cached); `accepted` resolves once the engine
    took it (or holds its InvalidRequestError). A pin the engine refuses is left out: a cache hint never
    fails its request."""

    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None
    session_id: str | None
    accepted: concurrent.futures.Future[None]
    pins: tuple[RequestPin, ...] = ()


@dataclass
class AddPin:
    """Pin a prefix; `ready` resolves once its prefill finished (or holds the engine's refusal)."""

    pin_id: str
    prompt_token_ids: list[int]
    ttl_s: float | None
    cache_salt: str | None
    ready: concurrent.futures.Future[PinInfo | None]


@dataclass
class DropPin:
    """Stop a pin's prefill if it is still in flight, and unpin it."""

    pin_id: str


@dataclass
class Abort:
    """Stop a request whose client went away."""

    request_id: str


@dataclass
class Call:
    """Run a function on the loop thread; `result` gets what it returns or raises."""

    fn: Callable[[LLMEngine], Any]
    result: concurrent.futures.Future[Any]


class Stop:
    """End the loop: fail whatever is in flight or queued."""


Command = Add | AddPin | DropPin | Abort | Call | Stop


def fail_unapplied(commands: list[Command], error: Exception) -> None:
    """Hand `error` to whoever waits on a command the loop will never apply (it is shutting down)."""
    for command in commands:
        if isinstance(command, Add) and command.accepted.set_running_or_notify_cancel():
            command.accepted.set_exception(error)
        elif isinstance(command, Call) and command.result.set_running_or_notify_cancel():
            command.result.set_exception(error)
        elif isinstance(command, AddPin) and command.ready.set_running_or_notify_cancel():
            command.ready.set_exception(error)
