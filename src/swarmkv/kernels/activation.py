"""SwiGLU's silu(gate) * up over a fused gate-up row in one Triton launch, beside its torch reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swarmkv.kernels.reference import silu_and_mul as silu_and_mul_reference

__all__ = ["silu_and_mul", "silu_and_mul_reference"]

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
