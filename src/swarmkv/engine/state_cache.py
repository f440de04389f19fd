"""The recurrent-state tensors behind a hybrid model's state slots: per linear-attention layer and slot, the
causal conv's window (the model's dtype) and the delta rule's state matrices (at least float32, since they
accumulate over the whole context)."""

from __future__ import annotations

import torch

from swarmkv.config import ModelConfig


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
