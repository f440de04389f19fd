"""The shared layer vocabulary: RMSNorm (with the residual add fused in), rotary embedding, fused QKV and
gate-up projections, and the four ops they call: torch's (`kernels/reference.py`) or, on a GPU, Triton's."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from swarmkv.config import RopeScaling
from swarmkv.kernels.reference import add_rms_norm, apply_rotary, rms_norm, silu_and_mul
from swarmkv.models.quantized import WeightFormat, make_linear


@dataclass(frozen=True)
class LayerOps:
    """The ops the layers call, chosen once per engine: torch's everywhere, Triton kernels on a GPU."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    apply_rotary: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]
    ]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]


TORCH_OPS = LayerOps(rms_norm, add_rms_norm, apply_rotary, silu_and_mul)


def triton_ops() -> LayerOps:
    """The same ops as Triton kernels (one launch each; rotary in place on q and k)."""
    from swarmkv.kernels import activation, norm, rotary  # imports triton: only when asked for

    def rotate_in_place(
        positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rotary.apply_rotary_(positions, q, k, cos_sin)
        return q, k

    return LayerOps(norm.rms_norm, norm.add_rms_norm, rotate_in_place, activation.silu_and_mul)


class RMSNorm(nn.Module):
    """Root-mean-square norm; `add` fuses the residual add before it."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: LayerOps = TORCH_OPS) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add(
        self, x: torch.Tensor, residual: torch.Tensor, ops: LayerOps
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual) in one op."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Per-pair rotation frequencies, with linear or llama3 scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    if scaling.kind == "linear":
        return (inv_freq / scaling.factor).float()
    # llama3: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, blended, scaled).float()


class RotaryEmbedding(nn.Module):
    """Rotary position embedding over a cos/sin table built once for every position the model allows."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.cos_sin: torch.Tensor | None = None

    def build(self, device: torch.device) -> None:
        """Compute the [positions, head_dim] cos and sin tables on `device` (float32)."""
        inv_freq = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling)
        angles = torch.outer(torch.arange(self.max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos_sin = torch.stack([angles.cos(), angles.sin()]).to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, ops: LayerOps = TORCH_OPS
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] by their token positions [T]."""
        assert self.cos_sin is not None, "RotaryEmbedding.build() was not called"
        return ops.apply_rotary(positions, q, k, self.cos_sin)


class GatedMLP(nn.Module):
    """SwiGLU feed-forward with the gate and up projections fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, weights: WeightFormat = "float") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = make_linear(hidden_size, 2 * intermediate_size, False, weights)
        self.down_proj = make_linear(intermediate_size, hidden_size, False, weights)

    def forward(self, x: torch.Tensor, ops: LayerOps = TORCH_OPS) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
