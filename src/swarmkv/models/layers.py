"""The shared layer vocabulary: RMSNorm (with the residual add fused in), rotary embedding (with the q/k
norm fused in), fused QKV and gate-up projections, and the ops they call: torch's (`kernels/reference.py`)
or, on a GPU, Triton's, which fuse further (rotary with the KV store, the gate-up matmul with SwiGLU)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from swarmkv.config import RopeScaling
from swarmkv.kernels.reference import add_rms_norm, qk_norm_rotary, rms_norm, silu_and_mul
from swarmkv.models.attention import KVSlabs
from swarmkv.models.quantized import WeightFormat, make_linear

# positions [T], q [T, Hq, D], k [T, Hkv, D], cos_sin [2, P, R], the q and k norm weights (or None), eps
QKNormRotary = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, float],
    tuple[torch.Tensor, torch.Tensor],
]
# the same arguments with v [T, Hkv, D] after k, then where k and v are stored; returns q
QKNormRotaryStore = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor | None,
        float,
        KVSlabs,
    ],
    torch.Tensor,
]


@dataclass(frozen=True)
class LayerOps:
    """The ops the layers call, chosen once per engine: torch's everywhere, Triton kernels on a GPU."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    qk_norm_rotary: QKNormRotary
    # None where the ops cannot store KV themselves; the layer then hands k and v to the backend.
    qk_norm_rotary_store: QKNormRotaryStore | None
    # x [T, hidden] and the gate-up projection -> silu(gate) * up [T, intermediate]
    gate_up_silu: Callable[[torch.Tensor, nn.Module], torch.Tensor]


def _gate_up_then_silu(x: torch.Tensor, gate_up_proj: nn.Module) -> torch.Tensor:
    return silu_and_mul(gate_up_proj(x))


TORCH_OPS = LayerOps(rms_norm, add_rms_norm, qk_norm_rotary, None, _gate_up_then_silu)


def triton_ops() -> LayerOps:
    """The same ops as Triton kernels: one launch each, q/k norm, rotary and the KV store in one, and the
    gate-up matmul with SwiGLU in one for float weights at decode sizes."""
    from swarmkv.kernels import activation, norm, rotary  # imports triton: only when asked for

    def norm_rotate_store(
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos_sin: torch.Tensor,
        q_weight: torch.Tensor | None,
        k_weight: torch.Tensor | None,
        eps: float,
        slabs: KVSlabs,
    ) -> torch.Tensor:
        cache = (slabs.k, slabs.v, slabs.slots, slabs.k_scale, slabs.v_scale)
        return rotary.qk_norm_rotary_store(positions, q, k, v, cos_sin, q_weight, k_weight, eps, *cache)

    def gate_up_silu(x: torch.Tensor, gate_up_proj: nn.Module) -> torch.Tensor:
        if (
            isinstance(gate_up_proj, nn.Linear)  # float weights; quantized ones have their own matmuls
            and gate_up_proj.bias is None
            and gate_up_proj.weight.dtype == x.dtype
            and x.shape[0] <= activation.GATE_UP_MAX_ROWS
        ):
            return activation.gate_up_silu(x, gate_up_proj.weight)
        return activation.silu_and_mul(gate_up_proj(x))

    return LayerOps(norm.rms_norm, norm.add_rms_norm, rotary.qk_norm_rotary_, norm_rotate_store, gate_up_silu)


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

    def table(self) -> torch.Tensor:
        """The [2, positions, rotary dim] cos and sin rows."""
        assert self.cos_sin is not None, "RotaryEmbedding.build() was not called"
        return self.cos_sin


class GatedMLP(nn.Module):
    """SwiGLU feed-forward with the gate and up projections fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, weights: WeightFormat = "float") -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = make_linear(hidden_size, 2 * intermediate_size, False, weights)
        self.down_proj = make_linear(intermediate_size, hidden_size, False, weights)

    def forward(self, x: torch.Tensor, ops: LayerOps = TORCH_OPS) -> torch.Tensor:
        return self.down_proj(ops.gate_up_silu(x, self.gate_up_proj))
