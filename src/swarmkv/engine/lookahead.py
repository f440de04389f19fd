"""Async scheduling's one step of lookahead: a step's sampled ids stay on the device, where they become the next
step's input ids, and reach the host through a copy that the launch of that next step does not wait for.

`LLMEngine.step` then runs: schedule step n+1 (each request of step n holding a provisional last token) ->
launch it, its provisional inputs taken from step n's ids on the device -> read step n's ids (its copy is done
by then) and update the requests with them -> commit step n+1's chunks. So the host's scheduling and metadata
for step n+1 run while the device computes step n, as in vLLM's async scheduling. `Lookahead` is the one owner
of provisional tokens: it appends them at launch and takes them back when the ids are read or the step fails.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from swarmkv.core.processors import Processors
from swarmkv.core.scheduler import Chunk
from swarmkv.core.sequence import PROVISIONAL_TOKEN, Sequence, Status


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ids on `device` without waiting for the work queued there (through pinned memory on a GPU)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


@dataclass(frozen=True)
class ProvisionalInputs:
    """The previous step's sampled ids on the device, and each of its sampling requests' index among them: a
    decode chunk whose last token is provisional takes its input id from there."""

    sampled: torch.Tensor  # [N] int64, on the device
    index: dict[str, int]

    def rows(self, chunks: Iterable[Chunk]) -> tuple[list[int], list[int]]:
        """The rows of a flat batch of `chunks` (in order) whose input is provisional, and their ids' indices."""
        rows: list[int] = []
        picks: list[int] = []
        end = 0
        for chunk in chunks:
            end += chunk.num_tokens
            if chunk.token_ids[-1] == PROVISIONAL_TOKEN:
                rows.append(end - 1)
                picks.append(self.index[chunk.request_id])
        return rows, picks

    def fill(self, input_ids: torch.Tensor, chunks: Iterable[Chunk]) -> None:
        """Write the provisional rows' ids into `input_ids`, a flat batch of `chunks` on the device, in place."""
        self.fill_rows(input_ids, *self.rows(chunks))

    def fill_rows(self, input_ids: torch.Tensor, rows: list[int], picks: list[int]) -> None:
        """input_ids[rows] = the ids at `picks`, in place on the device, without waiting for it."""
        if rows:
            device = input_ids.device
            input_ids[_to_device(rows, device)] = self.sampled[_to_device(picks, device)].to(input_ids.dtype)


@dataclass(frozen=True)
class InFlight:
    """A step computed and sampled on the device whose ids the host has not read yet."""

    sampling: list[Chunk]  # the chunks that sampled, in the order of `sampled`
    sampled: torch.Tensor  # [N] int64, on the device
    host: torch.Tensor  # the copy on the host (pinned on a GPU), complete once `ready` is
    ready: torch.cuda.Event | None  # None off a GPU, where the copy completed at once

    @classmethod
    def start(cls, sampling: list[Chunk], sampled: torch.Tensor) -> InFlight:
        """Start copying `sampled` (one id per chunk of `sampling`) to the host without waiting for it."""
        if sampled.device.type != "cuda":
            return cls(sampling, sampled, sampled, None)
        host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        host.copy_(sampled, non_blocking=True)
        # On the stream of the ids' own device: the engine's thread may have another device current.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(sampled.device))
        return cls(sampling, sampled, host, ready)

    def inputs(self) -> ProvisionalInputs:
        """What the next step reads its provisional input ids from."""
        return ProvisionalInputs(self.sampled, {c.request_id: i for i, c in enumerate(self.sampling)})

    def tokens(self) -> list[int]:
        """The sampled ids, once the copy is done (the host waits here, and only here)."""
        if self.ready is not None:
            self.ready.synchronize()
        ids: list[int] = self.host.tolist()
        return ids


class Lookahead:
    """Async scheduling's state: the step launched last whose ids are not read yet."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.in_flight: InFlight | None = None

    def may_run_ahead(self, sampling: list[Chunk], processors: Processors) -> bool:
        """Whether the next step may be scheduled before the ids `sampling` samples are read: async scheduling
        is on, no chunk verified a draft (on the host) and no processor needs the ids first (a grammar's mask
        and the loop guard's penalty follow the last token; so does a draft, unless drafts back off)."""
        if not self.enabled or not sampling or any(c.draft for c in sampling):
            return False
        return not any(processors.needs_ids(c.request_id) for c in sampling)

    def launch(self, launched: InFlight) -> None:
        """Hold a launched step: each of its requests still running gets a provisional last token."""
        live = [c for c in launched.sampling if c.seq.status is Status.RUNNING]
        for chunk in live:
            chunk.seq.append_provisional()
        self.in_flight = launched if live else None

    def take(self) -> InFlight | None:
        """The step in flight, no longer held here: this step reads its ids."""
        in_flight, self.in_flight = self.in_flight, None
        return in_flight

    @staticmethod
    def settle(in_flight: InFlight) -> list[tuple[Chunk, int]]:
        """Read a launched step's ids (this may raise) and take back the provisional tokens they replace."""
        tokens = in_flight.tokens()
        for chunk in in_flight.sampling:
            Lookahead.drop(chunk.seq)
        return list(zip(in_flight.sampling, tokens, strict=True))

    @staticmethod
    def drop(seq: Sequence) -> None:
        """Take back a request's provisional token, if it holds one (its step failed)."""
        if seq.num_provisional_tokens:
            seq.drop_provisional()
