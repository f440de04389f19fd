"""x @ W.T on a GPU over a GGUF weight held at its file's bits (the grouped layout of models/gguf_quants.py;
docs/quantized-layouts.md): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K, on NVIDIA and AMD alike.

The layout's fields are the compile-time parameters of `kernels/quant_gemv.py`'s kernel, the one the int4 / int8
layouts run: code bits (4, 5, 6 or 8, with the high plane for 5 and 6), group size, code offset, minimums or none,
and one- or two-level group constants (a K-quant's integer sub-scale times its super-block's float16). So a GGUF
weight gets its 16-byte weight loads, its vector-unit GEMV at one or two rows and its fixed-order K split.
"""

from __future__ import annotations

import torch

from swarmkv.kernels.cpu_grouped import GroupedQuant  # the layout as a Protocol: kernels/ sits below models/
from swarmkv.kernels.quant_gemv import GemvPlan, GroupLevels, compute_units, plan_quant_gemv, quant_gemv

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def plan_grouped(num_rows: int, weight: GroupedQuant, units: int, x_bytes: int = 4) -> GemvPlan:
    """The launch grouped_matmul makes for `num_rows` rows of x (`x_bytes` an element) on `units` SMs / CUs."""
    n, k = weight.shape
    return plan_quant_gemv(num_rows, n, k, weight.bits, weight.group_size, units, x_bytes=x_bytes)


def grouped_matmul(
    x: torch.Tensor, weight: GroupedQuant, out: torch.Tensor | None = None, units: int | None = None
) -> torch.Tensor:
    """x [M, K] @ W.T as [M, N] in x's dtype, W held in the grouped layout on x's device; into `out` when given
    (any [M, N] view whose columns are contiguous: a fused projection's slice). `units`: the compute units the
    K split fills (default: the device's own)."""
    assert x.dim() == 2 and x.dtype in _FLOAT_DTYPES and x.stride(1) == 1, (
        "x must be [M, K] float, rows contiguous"
    )
    n, k = weight.shape
    assert x.shape[1] == k, f"x has {x.shape[1]} columns for a weight of {k}"
    scales, mins = weight.scales, weight.mins
    levels = None
    if scales.outer is not None:
        levels = GroupLevels(scales.outer, mins.outer if mins is not None else None)
    return quant_gemv(
        x,
        weight.low,
        scales.values,
        mins.values if mins is not None else None,
        bits=weight.bits,
        group=weight.group_size,
        offset=weight.offset,
        high=weight.high,
        levels=levels,
        num_sms=compute_units(x.device) if units is None else units,
        out=out,
    )
