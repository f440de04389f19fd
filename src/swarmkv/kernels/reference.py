"""The torch versions of the kernels' ops: what the models run on every device, and what the Triton kernels
beside this file are tested against. It imports no kernel and no triton, so `models/` imports it freely; the
int4 packing is here because it is the layout `quant_matmul.py` reads."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm over the last dim, computed in at least float32 as the reference models do."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the pre-norm block's residual add and its next norm."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] rotated by the [2, positions, D] cos/sin rows of their positions [T]."""
    cos, sin = cos_sin[:, positions].unsqueeze(2).to(q.dtype)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def qk_norm_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] RMS-normed per head (when weights are given), then their first R dims
    rotated by the [2, positions, R] cos/sin rows (the rest pass through, as partial rotary wants)."""
    if q_weight is not None and k_weight is not None:
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    rotary_dim = cos_sin.shape[-1]
    if rotary_dim == q.shape[-1]:
        return apply_rotary(positions, q, k, cos_sin)
    q_rot, k_rot = apply_rotary(positions, q[..., :rotary_dim], k[..., :rotary_dim], cos_sin)
    return torch.cat([q_rot, q[..., rotary_dim:]], dim=-1), torch.cat([k_rot, k[..., rotary_dim:]], dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's silu(gate) * up for a fused gate-up row [T, 2I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_silu(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """The gate-up projection [T, K] x [2I, K] -> [T, 2I] and SwiGLU over it -> [T, I]."""
    return silu_and_mul(F.linear(x, gate_up_weight))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] -> two per byte [N, K / 2], even k in the low nibble."""
    assert q.dtype == torch.uint8 and q.dim() == 2 and q.shape[1] % 2 == 0, "q must be uint8 [N, even K]"
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K / 2] bytes -> uint8 values 0..15 [N, K] (the inverse of pack_int4)."""
    assert packed.dtype == torch.uint8 and packed.dim() == 2, "packed must be uint8 [N, K / 2]"
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
