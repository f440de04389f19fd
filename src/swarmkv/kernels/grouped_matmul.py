"""x @ W.T in Triton over a GGUF weight held at its file's bits (the grouped layout of models/gguf_quants.py;
docs/quantized-layouts.md): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K, on NVIDIA and AMD alike.

The layout's fields are the kernel's compile-time parameters: code bits (4, 5, 6 or 8), group size, code offset,
minimums or none, and one- or two-level group constants (a K-quant's integer sub-scale times its super-block's
float16). W[n, k] = S[n, g] * (q[n, k] - offset) + M[n, g], formed in float32 in that order, then cast to x's dtype
for the dot (float32 dots are "ieee").

One program owns BLOCK_N output rows and walks a share of K in BLOCK_K steps. Every load runs along K, where each
row's bytes are contiguous: the codes of a row tile are one [BLOCK_N, BLOCK_K / 2] byte block (16 bytes a lane
where the compiler can prove alignment), and a group's constants are read once per group, not per weight. At
decode sizes (M up to DECODE_MAX_ROWS) a 16-row x tile covers every row, so each weight byte is read once; K is
split across programs (float32 partial sums, added in a fixed order) where N / BLOCK_N alone would leave the
device's compute units under-filled. Larger M (prefill) takes 64-row tiles.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from swarmkv.kernels.cpu_grouped import GroupedQuant  # the layout as a Protocol: kernels/ sits below models/

DECODE_MAX_ROWS = 16  # rows of x one BLOCK_M = 16 tile covers (tl.dot's smallest M)
PROGRAMS_PER_UNIT = 4  # programs a launch aims for per SM / CU before K is split
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Tiles(NamedTuple):
    """A launch's tile sizes and K split."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    splits: int


def compute_units(device: torch.device) -> int:
    """SMs or CUs of a GPU; 1 elsewhere (the interpreter)."""
    if device.type == "cuda":
        return _units(torch.cuda.current_device() if device.index is None else device.index)
    return 1


@functools.cache
def _units(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def choose_tiles(num_rows: int, n: int, k: int, group_size: int, units: int) -> Tiles:
    """Tile sizes by the rows of x; at decode, a K split that brings the programs up to PROGRAMS_PER_UNIT per
    compute unit (each split keeps at least 4 K steps, so the partial sums stay few)."""
    block_k = max(128, group_size)
    if num_rows > DECODE_MAX_ROWS:
        return Tiles(
            block_m=64, block_n=64, block_k=64 if group_size <= 64 else group_size, num_warps=4, splits=1
        )
    block_n = 32
    programs = triton.cdiv(n, block_n)
    steps = triton.cdiv(k, block_k)
    splits = 1
    while programs * splits < PROGRAMS_PER_UNIT * units and steps // (splits * 2) >= 4:
        splits *= 2
    return Tiles(block_m=16, block_n=block_n, block_k=block_k, num_warps=4, splits=splits)


@triton.jit
def _group_constants(
    Values, Outer, rn, n_ok, g, g_ok, stride_v, stride_o, TWO_LEVEL: tl.constexpr, PER_OUTER: tl.constexpr
):
    """Float32 constants [BLOCK_N, groups] of groups `g` of rows `rn`: values, times the outer float16 of
    their super-block when TWO_LEVEL (the product rounds as gguf's float32 d * sc does)."""
    mask = n_ok[:, None] & g_ok[None, :]
    values = tl.load(Values + rn[:, None] * stride_v + g[None, :], mask=mask, other=0).to(tl.float32)
    if TWO_LEVEL:
        outer = tl.load(Outer + rn[:, None] * stride_o + (g // PER_OUTER)[None, :], mask=mask, other=0.0)
        values = outer.to(tl.float32) * values
    return values


@triton.jit
def _grouped_matmul_kernel(
    X,
    Low,
    High,
    ScaleValues,
    ScaleOuter,
    MinValues,
    MinOuter,
    Out,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_low,
    stride_high,
    stride_sv,
    stride_so,
    stride_mv,
    stride_mo,
    stride_os,
    stride_om,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    OFFSET: tl.constexpr,
    HAS_MINS: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    PER_OUTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)  # int64: N * K passes 2**31 for a big vocab
    m_ok = rm < M
    n_ok = rn < N
    compute_ty = X.dtype.element_ty
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    k_start = pid_s * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < k_end
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        if BITS == 8:
            codes = tl.load(
                Low + rn[:, None] * stride_low + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0
            ).to(tl.int32)
        else:
            # Two codes a byte, low nibble first: one contiguous byte block per row tile, split in registers.
            rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            b_ok = n_ok[:, None] & (rb < k_end // 2)[None, :]
            packed = tl.load(Low + rn[:, None] * stride_low + rb[None, :], mask=b_ok, other=0).to(tl.int32)
            codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, BLOCK_K))
            if BITS == 5:  # bit k % 8 of byte k // 8
                rh = k0 // 8 + tl.arange(0, BLOCK_K // 8)
                h_ok = n_ok[:, None] & (rh < k_end // 8)[None, :]
                hb = tl.load(High + rn[:, None] * stride_high + rh[None, :], mask=h_ok, other=0).to(tl.int32)
                bits = (hb[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1
                codes = codes | (tl.reshape(bits, (BLOCK_N, BLOCK_K)) << 4)
            if BITS == 6:  # bits 2 (k % 4) and up of byte k // 4
                rh = k0 // 4 + tl.arange(0, BLOCK_K // 4)
                h_ok = n_ok[:, None] & (rh < k_end // 4)[None, :]
                hb = tl.load(High + rn[:, None] * stride_high + rh[None, :], mask=h_ok, other=0).to(tl.int32)
                bits = (hb[:, :, None] >> (2 * tl.arange(0, 4))[None, None, :]) & 3
                codes = codes | (tl.reshape(bits, (BLOCK_N, BLOCK_K)) << 4)
        g = k0 // GROUP + tl.arange(0, GROUPS)
        g_ok = g < tl.cdiv(k_end, GROUP)
        scales = _group_constants(
            ScaleValues, ScaleOuter, rn, n_ok, g, g_ok, stride_sv, stride_so, TWO_LEVEL, PER_OUTER
        )
        w = tl.reshape((codes - OFFSET).to(tl.float32), (BLOCK_N, GROUPS, GROUP)) * scales[:, :, None]
        if HAS_MINS:
            mins = _group_constants(
                MinValues, MinOuter, rn, n_ok, g, g_ok, stride_mv, stride_mo, TWO_LEVEL, PER_OUTER
            )
            w = w + mins[:, :, None]
        w = tl.reshape(w, (BLOCK_N, BLOCK_K))
        # Masked codes are 0 but a minimum is not: zero the columns past K so they add nothing.
        w = tl.where(k_ok[None, :], w, 0.0)
        acc += tl.dot(x, tl.trans(w.to(compute_ty)), input_precision="ieee")
    tl.store(
        Out + pid_s * stride_os + rm[:, None] * stride_om + rn[None, :],
        acc.to(Out.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


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
    num_rows = x.shape[0]
    assert x.shape[1] == k, f"x has {x.shape[1]} columns for a weight of {k}"
    assert k % weight.group_size == 0 and k % 8 == 0
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    assert out.shape == (num_rows, n) and out.dtype == x.dtype and (n == 1 or out.stride(1) == 1)
    if num_rows == 0 or n == 0:
        return out
    tiles = choose_tiles(
        num_rows, n, k, weight.group_size, compute_units(x.device) if units is None else units
    )
    # Each split starts on a K step (and so on a group and a code byte).
    k_per_split = triton.cdiv(triton.cdiv(k, tiles.splits), tiles.block_k) * tiles.block_k
    splits = triton.cdiv(k, k_per_split)
    partial = out if splits == 1 else torch.empty((splits, num_rows, n), dtype=torch.float32, device=x.device)
    scales, mins = weight.scales, weight.mins
    two_level = scales.outer is not None
    per_outer = scales.values.shape[1] // scales.outer.shape[1] if scales.outer is not None else 1
    dummy = weight.low  # stands for an absent tensor: never read
    high = weight.high if weight.high is not None else dummy
    grid = (triton.cdiv(n, tiles.block_n), splits, triton.cdiv(num_rows, tiles.block_m))
    _grouped_matmul_kernel[grid](
        x,
        weight.low,
        high,
        scales.values,
        scales.outer if scales.outer is not None else dummy,
        mins.values if mins is not None else dummy,
        mins.outer if mins is not None and mins.outer is not None else dummy,
        partial,
        num_rows,
        n,
        k,
        k_per_split,
        x.stride(0),
        weight.low.stride(0),
        high.stride(0),
        scales.values.stride(0),
        scales.outer.stride(0) if scales.outer is not None else 0,
        mins.values.stride(0) if mins is not None else 0,
        mins.outer.stride(0) if mins is not None and mins.outer is not None else 0,
        partial.stride(0) if splits > 1 else 0,
        partial.stride(-2),
        BITS=weight.bits,
        GROUP=weight.group_size,
        OFFSET=weight.offset,
        HAS_MINS=mins is not None,
        TWO_LEVEL=two_level,
        PER_OUTER=per_outer,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
    )
    if splits > 1:
        out.copy_(partial.sum(0))  # the splits' float32 partial sums in a fixed order, then x's dtype
    return out
