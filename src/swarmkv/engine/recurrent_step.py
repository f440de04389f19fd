"""One step of a hybrid model: attention goes to the attention backend, and linear-attention layers run
each sequence's new tokens from the state its slot holds, writing the new state back.

A speculative chunk (a request's last token and its draft) runs one position at a time, as decoding does,
and keeps the state after each position in the `StateCache`, so the engine can rewind its slot to the last
accepted one: the recurrent state never holds a rejected draft token."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from swarmkv.core.scheduler import Chunk
from swarmkv.engine.state_cache import StateCache
from swarmkv.models import gated_delta
from swarmkv.models.attention import AttentionBackend

# (the rows' inputs..., their state(s)) -> (the rows' outputs, the new state(s))
StateUpdate = Callable[..., tuple[torch.Tensor, torch.Tensor]]
# (one sequence's rows' inputs..., its state) -> (the rows' outputs, its state after each row: stacked, or
# one tensor a row)
PositionUpdate = Callable[..., tuple[torch.Tensor, torch.Tensor | list[torch.Tensor]]]


@dataclass(frozen=True)
class StateLayout:
    """Which state slot each row range of the flat batch continues: prefill chunks one at a time, speculative
    chunks one at a time position by position, then the decodes (one row each) together."""

    prefills: tuple[tuple[int, int, int], ...]  # (first row, rows, slot)
    decode_start: int
    decode_slots: torch.Tensor | None  # [B] slots of the decode rows, on the device
    speculative: tuple[tuple[int, int, int], ...] = ()  # (first row, rows, slot), among the prefills' rows


def build_state_layout(
    prefills: list[Chunk], decodes: list[Chunk], slots: dict[str, int], device: torch.device
) -> StateLayout:
    """The layout of a step whose flat batch holds `prefills` (speculative chunks among them) then `decodes`,
    in that order."""
    spans: list[tuple[int, int, int]] = []
    speculative: list[tuple[int, int, int]] = []
    row = 0
    for chunk in prefills:
        (speculative if chunk.draft else spans).append((row, chunk.num_tokens, slots[chunk.request_id]))
        row += chunk.num_tokens
    decode_slots = None
    if decodes:
        decode_slots = torch.tensor([slots[c.request_id] for c in decodes], dtype=torch.int64, device=device)
    return StateLayout(tuple(spans), row, decode_slots, tuple(speculative))


class RecurrentStep:
    """An AttentionBackend and RecurrentBackend for one step over the state slots of its sequences."""

    def __init__(self, attention: AttentionBackend, states: StateCache, layout: StateLayout) -> None:
        self.attention = attention
        self.states = states
        self.layout = layout
        states.begin_positions([slot for *_, slot in layout.speculative])

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention layers: the attention backend's business."""
        return self.attention.attend(layer, q, k, v)

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The causal conv of each sequence's new inputs, continuing from and updating its slot's window."""
        return self._per_sequence(
            self.states.conv[layer],
            torch.empty_like(x),
            lambda x_rows, window: gated_delta.causal_conv(x_rows, window, weight),
            lambda x_rows, windows: gated_delta.causal_conv_step(x_rows, windows, weight),
            lambda x_rows, window: conv_positions(x_rows, window, weight),
            lambda slot, kept: self.states.keep_positions(layer, slot, conv=kept),
            x,
        )

    def delta_rule(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """The gated delta rule per sequence: chunked over a prefill chunk, one recurrent step per decode."""
        return self._per_sequence(
            self.states.ssm[layer],
            torch.empty_like(v),
            gated_delta.gated_delta_chunked,
            gated_delta.gated_delta_step,
            delta_rule_positions,
            lambda slot, kept: self.states.keep_positions(layer, slot, ssm=kept),
            q,
            k,
            v,
            g,
            beta,
        )

    def _per_sequence(
        self,
        states: torch.Tensor,
        out: torch.Tensor,
        prefill: StateUpdate,
        decode: StateUpdate,
        positions: PositionUpdate,
        keep: Callable[[int, Any], None],
        *inputs: torch.Tensor,
    ) -> torch.Tensor:
        """`prefill` over each prefill chunk's rows of `inputs` from its slot's state, `positions` over each
        speculative chunk's (its state after every row goes to `keep`), then `decode` over all the decode
        rows; each writes its rows of `out` and its new states back into `states`."""
        for start, length, slot in self.layout.prefills:
            rows = slice(start, start + length)
            out[rows], states[slot] = prefill(*(t[rows] for t in inputs), states[slot])
        for start, length, slot in self.layout.speculative:
            rows = slice(start, start + length)
            out[rows], kept = positions(*(t[rows] for t in inputs), states[slot])
            states[slot] = kept[-1]
            keep(slot, kept)
        slots = self.layout.decode_slots
        if slots is not None:
            rows = slice(self.layout.decode_start, self.layout.decode_start + slots.shape[0])
            out[rows], new = decode(*(t[rows] for t in inputs), states[slots])
            states.index_copy_(0, slots, new)
        return out


def conv_positions(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal conv of one sequence's rows x [n, C] from `window` [C, K-1], as n decode steps compute it:
    (outputs [n, C], the window after each row [n, C, K-1])."""
    window_len = window.shape[1]
    assert window_len >= 1, "a conv of one tap keeps no window"
    inputs = torch.cat([window, x.t().to(window.dtype)], dim=1)  # [C, K-1+n]
    before = inputs.unfold(1, window_len, 1)[:, : x.shape[0]].transpose(0, 1)  # row j's window [n, C, K-1]
    return gated_delta.causal_conv_step(x, before, weight)


def delta_rule_positions(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The gated delta rule over one sequence's rows one step at a time, from `state` [Hv, Dk, Dv]: (outputs
    [n, Hv, Dv], the state after each row). A draft is a few rows: steps cost less than a chunk padded to 64,
    and compute what decoding the same tokens would."""
    out = torch.empty_like(v)
    kept: list[torch.Tensor] = []
    current = state.unsqueeze(0)
    for row in range(v.shape[0]):
        rows = slice(row, row + 1)
        out[rows], current = gated_delta.gated_delta_step(
            q[rows], k[rows], v[rows], g[rows], beta[rows], current
        )
        kept.append(current[0])
    return out, kept
