"""The attention seam: models hand q, k, v to a backend and never see how KV is stored. Hybrid models'
linear-attention layers hand their conv inputs and delta-rule terms to the same backend, which carries each
sequence's recurrent state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F

from swarmkv.models import gated_delta


class AttentionBackend(Protocol):
    """Computes attention for one step's new tokens, storing or reading KV as it sees fit."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Map q [T, Hq, D] and the new tokens' k, v [T, Hkv, D] to outputs [T, Hq, D]."""
        ...


@dataclass(frozen=True)
class KVSlabs:
    """Where one layer's new keys and values go: its cache slabs [slots, Hkv, D], one slot per new token
    (negative: store nothing) and an fp8 cache's scales (stored = value / scale)."""

    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor
    k_scale: float
    v_scale: float


@runtime_checkable
class StoresKV(Protocol):
    """A backend that lets the layer write the new keys and values itself, fused with the rotary that
    precedes the store, and then attends over what was stored."""

    def kv_slabs(self, layer: int) -> KVSlabs:
        """Where `layer`'s new keys and values go this step."""
        ...

    def attend_stored(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Like attend, for q [T, Hq, D] whose tokens' k and v are already in kv_slabs(layer)."""
        ...


@runtime_checkable
class RecurrentBackend(Protocol):
    """Runs a linear-attention layer's two sequential parts over each sequence's new tokens, starting from
    the state that sequence left and leaving its new state. `layer` counts linear-attention layers only."""

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv + SiLU of the new tokens' inputs x [T, C] (weight [C, K]) -> [T, C]."""
        ...

    def delta_rule(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """The gated delta rule over q, k [T, Hk, Dk], v [T, Hv, Dv], g, beta [T, Hv] -> [T, Hv, Dv]."""
        ...


class CausalSelfAttention:
    """One sequence attending to itself, with no cache: the full-sequence reference path. For hybrid
    models it also runs linear-attention layers over the whole sequence from a zero state."""

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

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The conv over the whole sequence, from an all-zero window."""
        window = x.new_zeros(x.shape[1], weight.shape[1] - 1)
        return gated_delta.causal_conv(x, window, weight)[0]

    def delta_rule(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
    ) -> torch.Tensor:
        """The chunked delta rule over the whole sequence, from a zero state."""
        dtype = torch.promote_types(v.dtype, torch.float32)
        state = v.new_zeros(v.shape[1], k.shape[2], v.shape[2], dtype=dtype)
        return gated_delta.gated_delta_chunked(q, k, v, g, beta, state)[0]
