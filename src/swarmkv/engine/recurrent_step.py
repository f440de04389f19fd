"""One step of a hybrid model: attention goes to the attention backend, and linear-attention layers run
each sequence's new tokens from the state its slot holds, writing the new state back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from swarmkv.core.scheduler import Chunk
from swarmkv.engine.state_cache import StateCache
from swarmkv.models import gated_delta
from swarmkv.models.attention import AttentionBackend

# (the rows' inputs..., their state(s)) -> (the rows' outputs, the new state(s))
StateUpdate = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class StateLayout:
    """Which state slot each row range of the flat batch continues: prefill chunks one at a time, then the
    decodes (one row each) together."""

    prefills: tuple[tuple[int, int, int], ...]  # (first row, rows, slot)
    decode_start: int
    decode_slots: torch.Tensor | None  # [B] slots of the decode rows, on the device


def build_state_layout(
    prefills: list[Chunk], decodes: list[Chunk], slots: dict[str, int], device: torch.device
) -> StateLayout:
    """The layout of a step whose flat batch holds `prefills` then `decodes`, in that order."""
    spans, row = [], 0
    for chunk in prefills:
        spans.append((row, chunk.num_tokens, slots[chunk.request_id]))
        row += chunk.num_tokens
    decode_slots = None
    if decodes:
        decode_slots = torch.tensor([slots[c.request_id] for c in decodes], dtype=torch.int64, device=device)
    return StateLayout(tuple(spans), row, decode_slots)


class RecurrentStep:
    """An AttentionBackend and RecurrentBackend for one step over the state slots of its sequences."""

    def __init__(self, attention: AttentionBackend, states: StateCache, layout: StateLayout) -> None:
        self.attention = attention
        self.states = states
        self.layout = layout

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
        *inputs: torch.Tensor,
    ) -> torch.Tensor:
        """`prefill` over each prefill chunk's rows of `inputs` from its slot's state, then `decode` over all
        the decode rows from theirs; each writes its rows of `out` and its new states back into `states`."""
        for start, length, slot in self.layout.prefills:
            rows = slice(start, start + length)
            out[rows], states[slot] = prefill(*(t[rows] for t in inputs), states[slot])
        slots = self.layout.decode_slots
        if slots is not None:
            rows = slice(self.layout.decode_start, self.layout.decode_start + slots.shape[0])
            out[rows], new = decode(*(t[rows] for t in inputs), states[slots])
            states.index_copy_(0, slots, new)
        return out
