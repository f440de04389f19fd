"""Weight-only quantized matmul in Triton: x @ W.T with W stored as int8 per output channel or as int4 groups
with a minimum, dequantised tile by tile inside the kernel, beside torch references.

Layouts (produced by the weight loaders):
- int8: qweight int8 [N, K], scales [N]; W[n, k] = qweight[n, k] * scales[n].
- int4: qweight uint8 [N, K // 2], element k of row n in byte k // 2, low nibble for even k, high nibble
  for odd k; scales and mins [N, K // G]; W[n, k] = q[n, k] * scales[n, k // G] + mins[n, k // G].
int4 runs `quant_gemv.py` (the kernel GGUF's grouped layout runs too: `grouped_matmul.py`) at every row count
(decode tiles up to GEMV_MAX_ROWS rows of x, prefill tiles above); int8 runs it at decode, and above runs the
tiled GEMM here, whose weight tiles already load as 16-byte copies: one program computes a BLOCK_M x BLOCK_N tile
of the output, walking K in BLOCK_K steps and accumulating in float32. Nothing assumes a warp width and every dot
is "ieee", so the same code runs on NVIDIA and AMD.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from swarmkv.kernels.quant_gemv import GEMV_MAX_ROWS, compute_units, quant_gemv, quant_gemv_supports
from swarmkv.kernels.reference import pack_int4, unpack_int4

__all__ = [
    "int4_matmul",
    "int4_matmul_reference",
    "int8_matmul",
    "int8_matmul_reference",
    "pack_int4",
    "unpack_int4",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class _Blocks(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int


# The int8 GEMM's tiles (more than GEMV_MAX_ROWS rows): a 64 x 128 float32 accumulator wants 8 warps' registers.
_GEMM_BLOCKS = _Blocks(block_m=64, block_n=128, block_k=64, num_warps=8)


@triton.jit
def _int8_matmul_kernel(
    X,
    W,
    Scales,
    Out,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # M blocks vary fastest, so the programs sharing a weight tile run together and hit the same cache lines.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    # int64 rows: N * K passes 2**31 for a big vocab head.
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok = rm < M
    n_ok = rn < N
    compute_ty = X.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # The weight tile is read transposed, [BLOCK_K, BLOCK_N]. Every int8 is exact in fp16 and bf16; the
        # cast goes through float32 because the interpreter turns an integer into bf16 as a bit pattern.
        q = tl.load(W + rn[None, :] * stride_wn + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0)
        acc += tl.dot(x, q.to(tl.float32).to(compute_ty), input_precision="ieee")
    # The per-channel scale is constant along K, so it is applied once to the float32 sums rather than
    # rounded into every weight: the same W, one multiply per output instead of one per weight.
    scale = tl.load(Scales + rn, mask=n_ok, other=0.0).to(tl.float32)
    out = acc * scale[None, :]
    tl.store(
        Out + rm[:, None] * stride_om + rn[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


def _check_x(x: torch.Tensor) -> None:
    assert x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with a contiguous last dim"
    assert x.dtype in _FLOAT_DTYPES, f"unsupported activation dtype {x.dtype}"


def int8_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    *,
    num_sms: int | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T for W = qweight int8 [N, K] * scales [N] per output channel, as [M, N] in x's dtype.
    `num_sms` (default: the device's) sizes a decode GEMV's K split; `splits` forces it."""
    _check_x(x)
    num_rows, k = x.shape
    n = qweight.shape[0]
    assert qweight.dtype == torch.int8 and qweight.shape == (n, k), f"qweight must be int8 [{n}, {k}]"
    assert qweight.stride(1) == 1, "qweight must have a contiguous last dim"
    assert scales.shape == (n,) and scales.dtype in _FLOAT_DTYPES and scales.is_contiguous()
    if 0 < num_rows <= GEMV_MAX_ROWS and n > 0 and quant_gemv_supports(k, 8, 0):
        sms = num_sms if num_sms is not None else compute_units(x.device)
        return quant_gemv(x, qweight, scales, None, bits=8, group=0, num_sms=sms, splits=splits)
    out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    blocks = _GEMM_BLOCKS
    grid = (triton.cdiv(num_rows, blocks.block_m), triton.cdiv(n, blocks.block_n))
    _int8_matmul_kernel[grid](
        x,
        qweight,
        scales,
        out,
        num_rows,
        n,
        k,
        x.stride(0),
        qweight.stride(0),
        out.stride(0),
        BLOCK_M=blocks.block_m,
        BLOCK_N=blocks.block_n,
        BLOCK_K=blocks.block_k,
        num_warps=blocks.num_warps,
    )
    return out


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


def int8_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What int8_matmul computes, in float32 torch, cast to x's dtype."""
    weight = qweight.float() * scales.float()[:, None]
    return (x.float() @ weight.T).to(x.dtype)


def int4_matmul_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int
) -> torch.Tensor:
    """What int4_matmul computes, in float32 torch, cast to x's dtype."""
    q = unpack_int4(qweight).float()
    scale = scales.float().repeat_interleave(group_size, dim=1)
    low = mins.float().repeat_interleave(group_size, dim=1)
    return (x.float() @ (q * scale + low).T).to(x.dtype)
