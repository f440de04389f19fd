"""Weight-only int4 matmul in Triton: x @ W.T with W stored as int4 groups with a minimum, beside a torch
reference.

Layout (produced by the weight loaders): qweight uint8 [N, K // 2], element k of row n in byte k // 2, low
nibble for even k, high nibble for odd k; scales and mins [N, K // G]; W[n, k] = q[n, k] * scales[n, k // G]
+ mins[n, k // G]. It runs `quant_gemv.py` (the kernel the grouped layout runs too: `grouped_matmul.py`) at every
row count: decode tiles up to GEMV_MAX_ROWS rows of x, prefill tiles above.
"""

from __future__ import annotations

import torch

from swarmkv.kernels.quant_gemv import compute_units, quant_gemv, quant_gemv_supports
from swarmkv.kernels.reference import pack_int4, unpack_int4

__all__ = ["int4_matmul", "int4_matmul_reference", "pack_int4", "unpack_int4"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _check_x(x: torch.Tensor) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with a contiguous last dim"
    assert x.dtype in _FLOAT_DTYPES, f"unsupported activation dtype {x.dtype}"


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    group_size: int,
    *,
    num_sms: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T for W = q * scales + mins per group of `group_size` along K, q packed two to a byte in
    qweight uint8 [N, K // 2] (scales, mins [N, K // group_size]), as [M, N] in x's dtype. `num_sms` (default:
    the device's) sizes a K split where the output has few tiles; `splits` forces it."""
    _check_x(x)
    num_rows, k = x.shape
    n = qweight.shape[0]
    assert k % group_size == 0 and quant_gemv_supports(k, 4, group_size), (
        f"K={k}: not a whole number of groups"
    )
    assert qweight.dtype == torch.uint8 and qweight.shape == (n, k // 2), (
        f"qweight must be uint8 [{n}, {k // 2}]"
    )
    assert qweight.stride(1) == 1, "qweight must have a contiguous last dim"
    groups = (n, k // group_size)
    assert scales.shape == groups and mins.shape == groups, f"scales and mins must be {list(groups)}"
    assert scales.dtype in _FLOAT_DTYPES and mins.dtype == scales.dtype
    assert scales.stride(1) == 1 and mins.stride(1) == 1, "scales and mins must have a contiguous last dim"
    if num_rows == 0 or n == 0:
        return torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    sms = num_sms if num_sms is not None else compute_units(x.device)
    return quant_gemv(x, qweight, scales, mins, bits=4, group=group_size, num_sms=sms, splits=splits)


def int4_matmul_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """What int4_matmul computes, in float32 torch, cast to x's dtype."""
    q = unpack_int4(qweight).float()
    scale = scales.float().repeat_interleave(group_size, dim=1)
    low = mins.float().repeat_interleave(group_size, dim=1)
    return (x.float() @ (q * scale + low).T).to(x.dtype)
