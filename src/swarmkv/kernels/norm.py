"""RMSNorm and fused residual-add + RMSNorm in Triton, a row or a few narrow rows a program, beside their torch
references."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swarmkv.kernels.reference import add_rms_norm as add_rms_norm_reference
from swarmkv.kernels.reference import rms_norm as rms_norm_reference

__all__ = ["add_rms_norm", "add_rms_norm_reference", "rms_norm", "rms_norm_reference"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The most elements one program holds: a row of a model 1024 wide or more is a program of its own.
_TILE_ELEMENTS = 1024


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    summed_ptr,
    x_row_stride,
    residual_row_stride,
    num_rows,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # ROWS rows a program. int64 row offsets: T * H can pass 2**31 elements on long prefills.
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    col_ok = cols < hidden_size
    mask = (row < num_rows) & col_ok
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # Round the sum to the activation dtype before normalising it, as torch's `x + residual` does.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(summed_ptr + row * hidden_size + cols, x, mask=mask)
    wide = x.to(tl.float32)
    # Masked lanes load 0, so they add nothing to the sum; divide by the true width, not BLOCK.
    mean_square = tl.sum(wide * wide, axis=1)[:, None] / hidden_size
    # Two roundings on purpose: the reference rounds the normed row to x's dtype, then multiplies
    # by the weight in float32 and rounds again.
    normed = (wide * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=col_ok, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * hidden_size + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows_a_program(num_tokens: int, block: int) -> int:
    """Rows a program takes: as many as fit _TILE_ELEMENTS (one row of a model 1024 wide or more)."""
    return min(triton.next_power_of_2(num_tokens), max(1, _TILE_ELEMENTS // block))


def _check_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [T, H] with a contiguous last dim"
    assert x.dtype in _SUPPORTED_DTYPES, f"unsupported dtype {x.dtype}"
    # The reference returns promote(weight, x) dtype; the kernel writes x's dtype, so they must agree.
    assert weight.dtype == x.dtype, f"weight dtype {weight.dtype} differs from x dtype {x.dtype}"
    assert weight.shape == (x.shape[1],) and weight.is_contiguous(), "weight must be a contiguous [H]"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, H] into a new contiguous tensor."""
    _check_inputs(x, weight)
    num_tokens, hidden_size = x.shape
    out = torch.empty((num_tokens, hidden_size), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = triton.next_power_of_2(hidden_size)
    rows = _rows_a_program(num_tokens, block)
    _rms_norm_kernel[(triton.cdiv(num_tokens, rows),)](
        x,
        x,  # no residual: the pointer is never read when HAS_RESIDUAL is False
        weight,
        out,
        out,
        x.stride(0),
        x.stride(0),
        num_tokens,
        hidden_size,
        eps,
        HAS_RESIDUAL=False,
        ROWS=rows,
        BLOCK=block,
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
    block = triton.next_power_of_2(hidden_size)
    rows = _rows_a_program(num_tokens, block)
    _rms_norm_kernel[(triton.cdiv(num_tokens, rows),)](
        x,
        residual,
        weight,
        out,
        summed,
        x.stride(0),
        residual.stride(0),
        num_tokens,
        hidden_size,
        eps,
        HAS_RESIDUAL=True,
        ROWS=rows,
        BLOCK=block,
    )
    return out, summed
