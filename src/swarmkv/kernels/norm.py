"""RMSNorm and fused residual-add + RMSNorm as one Triton program per row, beside their torch references."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swarmkv.kernels.reference import add_rms_norm as add_rms_norm_reference
from swarmkv.kernels.reference import rms_norm as rms_norm_reference

__all__ = ["add_rms_norm", "add_rms_norm_reference", "rms_norm", "rms_norm_reference"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    x_row_stride,
    residual_row_stride,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # int64 row offsets: T * H can pass 2**31 elements on long prefills.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype before normalising it, as torch's `x + residual` does.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(summed_ptr + row * hidden_size + cols, x, mask=mask)
    wide = x.to(tl.float32)
    # Masked lanes load 0, so they add nothing to the sum; divide by the true width, not BLOCK.
    mean_square = tl.sum(wide * wide, axis=0) / hidden_size
    # Two roundings on purpose: the reference rounds the normed row to x's dtype, then multiplies
    # by the weight in float32 and rounds again.
    normed = (wide * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * hidden_size + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [T, H] with a contiguous last dim"
    assert x.dtype in _SUPPORTED_DTYPES, f"unsupported dtype {x.dtype}"
    # The reference returns promote(weight, x) dtype; the kernel writes x's dtype, so they must agree.
    assert weight.dtype == x.dtype, f"weight dtype {weight.dtype} differs from x dtype {x.dtype}"
    assert weight.shape == (x.shape[1],) and weight.is_contiguous(), "weight must be a contiguous [H]"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, H] into a new contiguous tensor, one program per row."""
    _check_inputs(x, weight)
    num_tokens, hidden_size = x.shape
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    _rms_norm_kernel[(num_tokens,)](
        x,
        x,  # no residual: the pointer is never read when HAS_RESIDUAL is False
        weight,
        out,
        out,
        x.stride(0),
        x.stride(0),
        hidden_size,
        eps,
        HAS_RESIDUAL=False,
        BLOCK=triton.next_power_of_2(hidden_size),
    )
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rms_norm(x + residual), x + residual) from one kernel launch."""
    _check_inputs(x, weight)
    assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
    assert residual.stride(1) == 1, "residual must have a contiguous last dim"
    num_tokens, hidden_size = x.shape
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    summed = torch.empty_like(out)
    if num_tokens == 0:
        return out, summed
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual,
        weight,
        out,
        summed,
        x.stride(0),
        residual.stride(0),
        hidden_size,
        eps,
        HAS_RESIDUAL=True,
        BLOCK=triton.next_power_of_2(hidden_size),
    )
    return out, summed
