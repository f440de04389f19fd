"""One step of a hybrid model: attention goes to the attention backend, and linear-attention layers run
each sequence's new tokens from the state its slot holds, writing the new state back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarmkv.core.scheduler import Chunk
from swarmkv.engine.state_cache import StateCache
from swarmkv.models import gated_delta
from swarmkv.models.attention import AttentionBackend


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
        windows = self.states.conv[layer]
        out = torch.empty_like(x)
        for start, length, slot in self.layout.prefills:
            rows = slice(start, start + length)
            out[rows], windows[slot] = gated_delta.causal_conv(x[rows], windows[slot], weight)
        slots = self.layout.decode_slots
        if slots is not None:
            rows = slice(self.layout.decode_start, self.layout.decode_start + slots.shape[0])
            out[rows], new = gated_delta.causal_conv_step(x[rows], windows[slots], weight)
            windows.index_copy_(0, slots, new)
        return out

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
        states = self.states.ssm[layer]
        out = torch.empty_like(v)
        for start, length, slot in self.layout.prefills:
            r = slice(start, start + length)
            out[r], states[slot] = gated_delta.gated_delta_chunked(
                q[r], k[r], v[r], g[r], beta[r], states[slot]
            )
        slots = self.layout.decode_slots
        if slots is not None:
            r = slice(self.layout.decode_start, self.layout.decode_start + slots.shape[0])
            out[r], new = gated_delta.gated_delta_step(q[r], k[r], v[r], g[r], beta[r], states[slots])
            states.index_copy_(0, slots, new)
        return out
