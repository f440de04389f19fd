"""SwiGLU's silu(gate) * up in Triton, beside its torch references: over a fused gate-up row, or fused into
the gate-up matmul itself (one launch for both, and the [T, 2I] product is never written)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swarmkv.kernels.reference import gate_up_silu as gate_up_silu_reference
from swarmkv.kernels.reference import silu_and_mul as silu_and_mul_reference

__all__ = ["gate_up_silu", "gate_up_silu_reference", "silu_and_mul", "silu_and_mul_reference"]

# The fused matmul is a decode kernel: its 16-row tiles are tl.dot's least, and prefill batches are
# better served by the vendor GEMM, so rows past this take the matmul and silu_and_mul apart.
GATE_UP_MAX_ROWS = 64
_GATE_UP_BLOCK_M = 16
_GATE_UP_BLOCK_N = 64
_GATE_UP_BLOCK_K = 64

# Wide rows are split across programs so one program never holds more than this many columns.
_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, gate_up_row_stride, intermediate_size, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate_size
    gate_ptr = gate_up_ptr + row * gate_up_row_stride + cols
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + intermediate_size, mask=mask, other=0.0).to(tl.float32)
    # x / (1 + exp(-x)) is torch's silu formula; a huge negative x gives x / inf = -0, not NaN.
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * intermediate_size + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate_up[:, :I]) * gate_up[:, I:] into a new contiguous [T, I] tensor, computed in float32."""
    assert gate_up.dim() == 2 and gate_up.stride(1) == 1, "gate_up must be [T, 2I] with a contiguous last dim"
    assert gate_up.shape[1] % 2 == 0, "gate_up's last dim must be even"
    num_tokens = gate_up.shape[0]
    intermediate_size = gate_up.shape[1] // 2
    out = torch.empty((num_tokens, intermediate_size), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0 or intermediate_size == 0:
        return out
    block = min(triton.next_power_of_2(intermediate_size), _MAX_BLOCK)
    grid = (num_tokens, triton.cdiv(intermediate_size, block))
    _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), intermediate_size, BLOCK=block)
    return out


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,
    weight_ptr,
    out_ptr,
    num_rows,
    in_features,
    intermediate_size,
    x_row_stride,
    weight_row_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FLOAT32: tl.constexpr,
):
    # A program owns BLOCK_N columns of the output and reads their gate rows n and up rows I + n.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_rows
    col_ok = cols < intermediate_size
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_row_stride
    gate_rows = weight_ptr + cols.to(tl.int64)[:, None] * weight_row_stride  # [BLOCK_N, 1]
    up_rows = gate_rows + intermediate_size * weight_row_stride
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + ks
        k_ok = k < in_features
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w_gate = tl.load(gate_rows + k[None, :], mask=w_mask, other=0.0)  # each weight row read along K
        w_up = tl.load(up_rows + k[None, :], mask=w_mask, other=0.0)
        if DOT_FLOAT32:
            x, w_gate, w_up = x.to(tl.float32), w_gate.to(tl.float32), w_up.to(tl.float32)
        # "ieee": float32 stays exact (no tf32), as the unfused float32 matmul is.
        gate = tl.dot(x, tl.trans(w_gate), gate, input_precision="ieee")
        up = tl.dot(x, tl.trans(w_up), up, input_precision="ieee")
    # Round the products to the activation dtype first, as the unfused path's matmul output is.
    gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
    up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    out_offsets = rows.to(tl.int64)[:, None] * intermediate_size + cols[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def gate_up_silu(x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
    """silu(x @ W[:I].T) * (x @ W[I:].T) for x [T, K] (T <= GATE_UP_MAX_ROWS) and the fused gate-up weight
    W [2I, K], into a new contiguous [T, I] tensor, in one launch."""
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [T, K] with a contiguous last dim"
    assert x.shape[0] <= GATE_UP_MAX_ROWS, "the fused gate-up matmul is for decode batches"
    assert gate_up_weight.dim() == 2 and gate_up_weight.stride(1) == 1 and gate_up_weight.shape[0] % 2 == 0
    assert gate_up_weight.shape[1] == x.shape[1] and gate_up_weight.dtype == x.dtype, "weight must match x"
    num_tokens, in_features = x.shape
    intermediate_size = gate_up_weight.shape[0] // 2
    out = torch.empty((num_tokens, intermediate_size), dtype=x.dtype, device=x.device)
    if num_tokens == 0 or intermediate_size == 0:
        return out
    grid = (triton.cdiv(num_tokens, _GATE_UP_BLOCK_M), triton.cdiv(intermediate_size, _GATE_UP_BLOCK_N))
    _gate_up_silu_kernel[grid](
        x,
        gate_up_weight,
        out,
        num_tokens,
        in_features,
        intermediate_size,
        x.stride(0),
        gate_up_weight.stride(0),
        BLOCK_M=_GATE_UP_BLOCK_M,
        BLOCK_N=_GATE_UP_BLOCK_N,
        BLOCK_K=_GATE_UP_BLOCK_K,
        # triton 3.7.1's interpreter multiplies bfloat16 tiles wrongly (garbage, not rounding): widen them there
        DOT_FLOAT32=x.dtype == torch.bfloat16 and triton.knobs.runtime.interpret,
    )
    return out
