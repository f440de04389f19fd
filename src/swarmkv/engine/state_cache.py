"""The recurrent-state tensors behind a hybrid model's state slots: per linear-attention layer and slot, the
causal conv's window (the model's dtype) and the delta rule's state matrices (at least float32, since they
accumulate over the whole context).

Speculative decoding keeps a verification chunk exact here: while a step runs, each speculative chunk keeps
the state after every one of its positions (`keep_positions`), and once its draft is verified the slot is
rewound to the state after the last accepted position (`rewind`). A slot so holds, between steps, exactly
the state after its request's computed tokens, which is all a snapshot ever copies."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from swarmkv.config import ModelConfig


@dataclass
class PositionStates:
    """One speculative chunk's states after each of its n positions, per linear-attention layer: the conv
    windows [n, C, K-1] and the delta rule's states (n of [Hv, Dk, Dv], as the recurrence made them)."""

    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    ssm: dict[int, list[torch.Tensor]] = field(default_factory=dict)


class StateCache:
    """Preallocated states for every slot of the pool; implements the KV manager's `StateMover`."""

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        shape = config.linear
        assert shape is not None, "only a hybrid model keeps recurrent state"
        layers = config.num_linear_layers
        self.conv = torch.zeros(
            (layers, num_slots, shape.conv_dim, shape.conv_kernel - 1), dtype=dtype, device=device
        )
        self.ssm = torch.zeros(
            (layers, num_slots, shape.num_value_heads, shape.key_head_dim, shape.value_head_dim),
            dtype=torch.promote_types(dtype, torch.float32),
            device=device,
        )
        self.num_slots = num_slots
        # This step's speculative chunks, by slot: transient, at most a step's draft rows of states.
        self._positions: dict[int, PositionStates] = {}

    @property
    def bytes_per_slot(self) -> int:
        """Bytes one slot holds across layers."""
        conv = self.conv[:, 0].numel() * self.conv.element_size()
        return conv + self.ssm[:, 0].numel() * self.ssm.element_size()

    def copy_state(self, src: int, dst: int) -> None:
        """Copy every layer's state of slot `src` into slot `dst`."""
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]

    def reset_state(self, slot: int) -> None:
        """Zero slot `slot`: the state before any token."""
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()

    def begin_positions(self, slots: list[int]) -> None:
        """A step's speculative chunks (by their slots) start keeping per-position states; an earlier step's
        that were never rewound (a failed step) go."""
        self._positions = {slot: PositionStates() for slot in slots}

    def keep_positions(
        self,
        layer: int,
        slot: int,
        conv: torch.Tensor | None = None,
        ssm: list[torch.Tensor] | None = None,
    ) -> None:
        """Keep one layer's states after each position of the speculative chunk in `slot` (its slot holds
        the state after the last already)."""
        kept = self._positions[slot]
        if conv is not None:
            kept.conv[layer] = conv
        if ssm is not None:
            kept.ssm[layer] = ssm

    def rewind(self, slot: int, num_positions: int) -> None:
        """Set `slot` to the state after the first `num_positions` positions of its speculative chunk (its
        last token and the draft tokens accepted), and let the chunk's kept states go."""
        kept = self._positions.pop(slot)
        assert len(kept.conv) == len(kept.ssm) == self.conv.shape[0], "a layer kept no positions"
        if num_positions == len(next(iter(kept.ssm.values()))):
            return  # the whole draft was accepted: the slot holds its state already
        for layer, windows in kept.conv.items():
            self.conv[layer, slot] = windows[num_positions - 1]
        for layer, states in kept.ssm.items():
            self.ssm[layer, slot] = states[num_positions - 1]
