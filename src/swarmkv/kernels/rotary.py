"""Rotary position embedding (NeoX rotate-half) applied in place to q and k in one Triton launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swarmkv.kernels.reference import apply_rotary as apply_rotary_reference

__all__ = ["apply_rotary_", "apply_rotary_reference"]


@triton.jit
def _rotate_head(head_ptr, cos_ptr, sin_ptr, offs, mask, half):
    x1 = tl.load(head_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(head_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
    # Both halves of the table are read, not just the first: the reference multiplies by the
    # full row, so a table whose halves differ still matches.
    cos1 = tl.load(cos_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos1 - x2 * sin1
    out2 = x2 * cos2 + x1 * sin2
    tl.store(head_ptr + offs, out1.to(head_ptr.dtype.element_ty), mask=mask)
    tl.store(head_ptr + half + offs, out2.to(head_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    cos_sin_ptr,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    table_kind_stride,
    table_position_stride,
    num_q_heads,
    half,
    BLOCK_HALF: tl.constexpr,
):
    # Grid (T, Hq + Hkv): heads [0, Hq) are q's, the rest k's, so one launch covers both.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos_ptr = cos_sin_ptr + position * table_position_stride
    sin_ptr = cos_ptr + table_kind_stride
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < half
    if head < num_q_heads:
        _rotate_head(
            q_ptr + token * q_token_stride + head * q_head_stride, cos_ptr, sin_ptr, offs, mask, half
        )
    else:
        k_head = head - num_q_heads
        _rotate_head(
            k_ptr + token * k_token_stride + k_head * k_head_stride, cos_ptr, sin_ptr, offs, mask, half
        )


def apply_rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by the cos/sin rows [2, P, D] at positions [T]."""
    assert q.dim() == 3 and k.dim() == 3, "q and k must be [T, heads, D]"
    assert q.stride(2) == 1 and k.stride(2) == 1, "q and k must have a contiguous last dim"
    assert q.dtype == k.dtype, f"q dtype {q.dtype} differs from k dtype {k.dtype}"
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, "k must match q in tokens and head dim"
    assert positions.shape == (num_tokens,), "positions must be [T]"
    assert head_dim % 2 == 0, "rotate-half needs an even head dim"
    assert cos_sin.dim() == 3 and cos_sin.shape[0] == 2 and cos_sin.shape[2] == head_dim
    assert cos_sin.stride(2) == 1, "cos_sin must have a contiguous last dim"
    num_heads = num_q_heads + k.shape[1]
    if num_tokens == 0 or num_heads == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens, num_heads)](
        positions,
        q,
        k,
        cos_sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin.stride(0),
        cos_sin.stride(1),
        num_q_heads,
        half,
        BLOCK_HALF=triton.next_power_of_2(half),
    )
