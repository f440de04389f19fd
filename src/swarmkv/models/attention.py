"""The attention seam: models hand q, k, v to a backend and never see how KV is stored."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class AttentionBackend(Protocol):
    """Computes attention for one step's new tokens, storing or reading KV as it sees fit."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Map q [T, Hq, D] and the new tokens' k, v [T, Hkv, D] to outputs [T, Hq, D]."""
        ...


class CausalSelfAttention:
    """One sequence attending to itself, with no cache: the full-sequence reference path."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the sequence's tokens over each other."""
        # 4-D [1, heads, tokens, dim] inputs: CPU SDPA takes its fast flash path only for those.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            k.transpose(0, 1)[None],
            v.transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
