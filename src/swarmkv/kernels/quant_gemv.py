"""The quantized matmul in Triton, for the int4 layout and the grouped one (GGUF's types, int8) alike:
x [M, K] @ W.T, each lane loading its weight bytes along K in 16-byte chunks, so a decode step (M up to
GEMV_MAX_ROWS: a GEMV) reads each weight byte once.

The weight layouts are those of docs/quantized-layouts.md: codes q row-major along K, two to a byte (element k in
byte k // 2, the low nibble for even k) or one signed byte each, and W[n, k] = S[n, g] * (q[n, k] - OFFSET)
+ M[n, g] with g = k // GROUP. 5- and 6-bit codes add a `high` plane of
the bits above the nibble, a chunk's high bits read as one word (HIGH_BITS a code); S and M are float, or (TWO_LEVEL, GGUF's
K-quants) an integer per group times a float per PER_OUTER groups, multiplied in float32. Bits, group, offset,
minimums and the constants' levels are compile-time parameters.

A program owns BLOCK_M rows of x, BLOCK_N weight rows and one K split. Each K step loads a
[BLOCK_N, BLOCK_C, CHUNK_BYTES] tile of bytes, a chunk holding codes of one group only, so each lane reads its
chunk's scale and minimum once. With one or two rows of x the products are summed on the vector units per chunk,
`S * (q . x) + (M - S * OFFSET) * sum(x)`; with more, the chunk is dequantised and fed to tl.dot. Decode tiles are
narrow with a long K step and split K when the output has too few tiles to fill the device; a split writes float32
partials that a second small kernel sums in split order, so results do not depend on timing. Prefill tiles are
64 x 128 with a short K step, reusing each weight tile for 64 rows of x.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from swarmkv.kernels.reference import unpack_int4

GEMV_MAX_ROWS = 32  # rows of x up to which decode tiles run; above, prefill tiles reuse each weight tile
FMA_MAX_ROWS = (
    2  # rows the vector units take without tl.dot (at 4 the decode tile spills on gfx1201 and sm_90)
)
CHUNK_BYTES = 16  # bytes of codes a lane loads at once: one 128-bit load on every target
HIGH_WORD_BITS = 32  # the most high-plane bits a chunk reads, as one word: 32 codes of 5 bits, 16 of 6
STEPS_PER_SPLIT_MIN = (
    4  # K steps a split keeps at least, so its setup and partial stay small against its loads
)
PROGRAMS_PER_SM = (
    8  # split K until about this many programs per SM (CU) keep bytes in flight (a guess: unmeasured)
)


class GemvPlan(NamedTuple):
    """The launch of one quantized matmul: tile sizes and the K split."""

    block_m: int
    block_n: int
    block_c: int
    chunk_bytes: int
    num_warps: int
    use_dot: bool
    splits: int
    steps_per_split: int


def compute_units(device: torch.device) -> int:
    """Streaming multiprocessors (CUs on AMD) of a GPU; 1 elsewhere (the interpreter: no split is needed)."""
    if device.type == "cuda":
        return _units(torch.cuda.current_device() if device.index is None else device.index)
    return 1


@functools.cache
def _units(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def _low_bits(bits: int) -> int:
    """Bits of a code in the `low` plane: a nibble, or a whole byte for 8-bit codes."""
    return 8 if bits == 8 else 4


def quant_gemv_supports(k: int, bits: int, group: int) -> bool:
    """Whether quant_gemv takes this K and group: whole bytes per chunk (and per high word), whole chunks per row."""
    if group <= 0:
        return False
    codes = _chunk_codes(bits, group)
    return codes * _low_bits(bits) % 8 == 0 and codes * (bits - _low_bits(bits)) % 8 == 0 and k % codes == 0


def _chunk_codes(bits: int, group: int) -> int:
    """Codes a lane loads at once: 16 bytes' worth, fewer where they would span two groups or pass a high word."""
    full = CHUNK_BYTES * 8 // _low_bits(bits)
    if bits > _low_bits(bits):
        full = min(full, HIGH_WORD_BITS // (bits - _low_bits(bits)))
    return math.gcd(group, full)


def _chunk_bytes(bits: int, group: int) -> int:
    return _chunk_codes(bits, group) * _low_bits(bits) // 8


def plan_quant_gemv(
    num_rows: int,
    n: int,
    k: int,
    bits: int,
    group: int,
    num_sms: int,
    splits: int | None = None,
    x_bytes: int = 2,
) -> GemvPlan:
    """Tiles for `num_rows` rows of x (`x_bytes` an element), and a K split that gives about PROGRAMS_PER_SM
    programs per SM (`splits` forces one)."""
    chunk_bytes = _chunk_bytes(bits, group)  # of the low plane
    use_dot = num_rows > FMA_MAX_ROWS
    if num_rows <= GEMV_MAX_ROWS:
        block_m = (
            triton.next_power_of_2(num_rows) if not use_dot else max(16, triton.next_power_of_2(num_rows))
        )
        # A K step reads a 128-byte line of each of 32 rows: two 16-byte chunks in flight per lane of 4 warps
        # of 32, one per lane of 4 waves of 64.
        # float32 x takes the prefill step: its tl.dot has no matrix instruction on RDNA4 and runs on registers.
        block_n, num_warps, step_bytes = 32, 4, 128 if x_bytes < 4 or not use_dot else 32
        if bits > _low_bits(bits):
            # The high plane adds a quarter (5 bits) or half (6) to each step's bytes: at a 128-byte step
            # Q5_K / Q6_K held 168-211 registers at M=8 on sm_90 and gfx1201, at 64 bytes 92-116.
            step_bytes //= 2
    else:
        # 32 bytes a row per K step: a 128-byte step held 256 VGPRs and spilled on gfx1201 at these tiles.
        block_m, block_n, num_warps, step_bytes = 64, 128, 8, 32
    block_c = max(1, step_bytes // chunk_bytes)
    codes_per_step = block_c * chunk_bytes * 8 // _low_bits(bits)
    num_steps = max(1, triton.cdiv(k, codes_per_step))
    programs = triton.cdiv(n, block_n) * triton.cdiv(num_rows, block_m)
    if splits is None:
        wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, programs)
        # float32 partials, written and read back (8 bytes an output a split), stay within a quarter of the
        # weight's bytes: this keeps prefill and wide decodes unsplit.
        by_traffic = k * bits // (4 * 8 * 8 * num_rows)
        splits = max(1, min(wanted, num_steps // STEPS_PER_SPLIT_MIN, by_traffic))
    splits = max(1, min(splits, num_steps))
    steps_per_split = triton.cdiv(num_steps, splits)
    splits = triton.cdiv(num_steps, steps_per_split)  # no empty split
    return GemvPlan(block_m, block_n, block_c, chunk_bytes, num_warps, use_dot, splits, steps_per_split)


@triton.jit
def _group_constants(
    Values, Outer, rn, group, ok, stride_v, stride_o, TWO_LEVEL: tl.constexpr, PER_OUTER: tl.constexpr
):
    """Float32 constants [BLOCK_N, BLOCK_C] of groups `group` of rows `rn`: the values, times the outer float of
    their super-block when TWO_LEVEL (the product rounds as gguf's float32 d * sc does)."""
    values = tl.load(Values + rn[:, None] * stride_v + group[None, :], mask=ok, other=0).to(tl.float32)
    if TWO_LEVEL:
        outer = tl.load(Outer + rn[:, None] * stride_o + (group // PER_OUTER)[None, :], mask=ok, other=0.0)
        values = outer.to(tl.float32) * values
    return values


@triton.jit
def _quant_gemv_kernel(
    X,
    W,
    High,
    Scales,
    ScaleOuter,
    Mins,
    MinOuter,
    Out,
    M,
    N,
    K,
    steps_per_split,
    stride_xm,
    stride_wn,
    stride_hn,
    stride_sn,
    stride_so,
    stride_mn,
    stride_mo,
    stride_om,
    stride_os,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    OFFSET: tl.constexpr,
    HAS_MINS: tl.constexpr,
    TWO_LEVEL: tl.constexpr,
    PER_OUTER: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_C: tl.constexpr,
    CHUNK_BYTES: tl.constexpr,
    USE_DOT: tl.constexpr,
    SPLIT: tl.constexpr,
):
    LOW_BITS: tl.constexpr = 8 if BITS == 8 else 4
    HIGH_BITS: tl.constexpr = BITS - LOW_BITS  # 1 or 2 bits a code in the high plane's words, else 0
    CODES: tl.constexpr = CHUNK_BYTES * 8 // LOW_BITS  # codes per chunk
    STEP_BYTES: tl.constexpr = BLOCK_C * CHUNK_BYTES
    # M blocks vary fastest, so the programs sharing a weight tile run together and hit the same cache lines.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    # int64 rows: N * K passes 2**31 for a big vocab head.
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    m_ok = rm < M
    n_ok = rn < N
    chunk = tl.arange(0, BLOCK_C)
    row_bytes = K * LOW_BITS // 8
    compute_ty = X.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    step_lo = split * steps_per_split
    step_hi = tl.minimum(step_lo + steps_per_split, tl.cdiv(row_bytes, STEP_BYTES))
    for step in range(step_lo, step_hi):
        # K is a multiple of CODES, so a chunk is wholly inside K or wholly past it.
        chunk_byte = step * STEP_BYTES + chunk * CHUNK_BYTES  # [C]
        c_ok = chunk_byte < row_bytes
        chunk_k = chunk_byte * 8 // LOW_BITS  # first code of each chunk
        w_ptrs = W + rn[:, None, None] * stride_wn + chunk_byte[None, :, None] + tl.arange(0, CHUNK_BYTES)
        w_ok = n_ok[:, None, None] & c_ok[None, :, None]
        s_ok = n_ok[:, None] & c_ok[None, :]
        packed = tl.load(w_ptrs, mask=w_ok, other=0)
        if LOW_BITS == 4:
            even, odd = packed & 0xF, packed >> 4
            if HIGH_BITS > 0:
                # A chunk's high bits are one word of the plane (the host views it so), code j at bit HIGH_BITS j;
                # shifted per byte of `packed`, so a byte's two codes meet their high bits in its own layout.
                word_ptrs = High + rn[:, None, None] * stride_hn + (chunk_k // CODES)[None, :, None]
                word = tl.load(word_ptrs, mask=w_ok, other=0).to(tl.int32)  # [N, C, 1]
                pair = word >> (2 * HIGH_BITS * tl.arange(0, CHUNK_BYTES))[None, None, :]
                high_mask: tl.constexpr = (1 << HIGH_BITS) - 1
                even = even | ((pair & high_mask) << 4).to(tl.uint8)
                odd = odd | (((pair >> HIGH_BITS) & high_mask) << 4).to(tl.uint8)
            # even k: the low nibble; join puts each byte's two codes side by side, in k order.
            q = tl.join(even, odd).reshape(BLOCK_N, BLOCK_C, CODES).to(tl.float32)
        else:
            q = packed.to(tl.float32)
        group = chunk_k // GROUP
        scale = _group_constants(
            Scales, ScaleOuter, rn, group, s_ok, stride_sn, stride_so, TWO_LEVEL, PER_OUTER
        )
        if HAS_MINS:
            mins = _group_constants(
                Mins, MinOuter, rn, group, s_ok, stride_mn, stride_mo, TWO_LEVEL, PER_OUTER
            )
        if USE_DOT:
            rk = step * (STEP_BYTES * 8 // LOW_BITS) + tl.arange(0, BLOCK_C * CODES)
            x_ptrs = X + rm[:, None] * stride_xm + rk[None, :]
            x = tl.load(x_ptrs, mask=m_ok[:, None] & (rk < K)[None, :], other=0.0).to(compute_ty)
            # S * (q - OFFSET) + M in float32, in gguf's order: a float32 x meets the exact dequantised weight.
            w = (q - OFFSET) * scale[:, :, None]
            if HAS_MINS:
                w += mins[:, :, None]
            w = w.to(compute_ty).reshape(BLOCK_N, BLOCK_C * CODES)
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            # Per chunk, W . x = S * (q . x) + (M - S * OFFSET) * sum(x): the offset and minimum once a chunk.
            low = -OFFSET * scale
            if HAS_MINS:
                low += mins
            # A row of x at a time keeps the products in q's layout, each lane's chunk against its own codes' x:
            # a [M, N, C, CODES] product would be laid out along CODES and move q through shared memory.
            for r in tl.static_range(BLOCK_M):
                row = pid_m * BLOCK_M + r
                xr_ptrs = X + row.to(tl.int64) * stride_xm + chunk_k[:, None] + tl.arange(0, CODES)[None, :]
                xr = tl.load(xr_ptrs, mask=(row < M) & c_ok[:, None], other=0.0).to(tl.float32)  # [C, CODES]
                qx = tl.sum(q * xr[None, :, :], axis=2)  # [N, C]
                part = tl.sum(qx * scale + tl.sum(xr, axis=1)[None, :] * low, axis=1)  # [N]
                acc += tl.where(tl.arange(0, BLOCK_M)[:, None] == r, part[None, :], 0.0)
    out_ptrs = Out + split * stride_os + rm[:, None] * stride_om + rn[None, :]
    out_ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.store(out_ptrs, acc, mask=out_ok)
    else:
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=out_ok)


@triton.jit
def _sum_splits_kernel(Partials, Out, N, splits, stride_ps, stride_pm, stride_om, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, splits):  # in split order: the same sums, bit for bit, on every run
        total += tl.load(Partials + s * stride_ps + row * stride_pm + cols, mask=ok, other=0.0)
    tl.store(Out + row * stride_om + cols, total.to(Out.dtype.element_ty), mask=ok)


class GroupLevels(NamedTuple):
    """The second level of a layout's group constants: the float per super-block that each group's integer
    scale (and minimum) multiplies, [N, K // (group * per_outer)] (GGUF's K-quants' d and -dmin)."""

    scale_outer: torch.Tensor
    min_outer: torch.Tensor | None


def _high_words(high: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """The high plane viewed as one signed word per chunk (the kernel masks the bits it shifts down)."""
    word_bytes = _chunk_codes(bits, group) * (bits - 4) // 8
    dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32}[word_bytes]
    return high.view(torch.uint8).view(dtype)


def quant_gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    *,
    bits: int,
    group: int,
    offset: int = 0,
    high: torch.Tensor | None = None,
    levels: GroupLevels | None = None,
    num_sms: int,
    splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] @ W.T as [M, N] in x's dtype, for W in the layout above: qweight uint8 [N, K // 2] (bits 4, 5, 6)
    or int8 [N, K] (bits 8), and for 5 or 6 bits the `high` plane uint8 [N, K * (bits - 4) // 8]; scales (and
    mins) [N, K // group], float or (with `levels`) integers. Into `out` when given
    (an [M, N] view whose columns are contiguous). The caller checks shapes; `num_sms` sizes the K split,
    `splits` forces it."""
    num_rows, k = x.shape
    n = qweight.shape[0]
    assert quant_gemv_supports(k, bits, group), f"K={k} must be whole chunks of codes, in groups along K"
    assert (high is None) == (bits in (4, 8)), "5- and 6-bit codes need their high plane, others have none"
    assert levels is None or (levels.min_outer is None) == (mins is None), (
        "minimums take their own outer floats"
    )
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    assert out.shape == (num_rows, n) and out.dtype == x.dtype and (n <= 1 or out.stride(1) == 1)
    if num_rows == 0 or n == 0:
        return out
    plan = plan_quant_gemv(num_rows, n, k, bits, group, num_sms, splits, x.element_size())
    split = plan.splits > 1
    target = torch.empty((plan.splits, num_rows, n), dtype=torch.float32, device=x.device) if split else out
    words = _high_words(high, bits, group) if high is not None else qweight  # never read without high bits
    scale_outer = levels.scale_outer if levels is not None else scales  # never read without TWO_LEVEL
    min_outer = levels.min_outer if levels is not None and levels.min_outer is not None else scale_outer
    per_outer = scales.shape[1] // scale_outer.shape[1] if levels is not None else 1
    grid = (triton.cdiv(num_rows, plan.block_m), triton.cdiv(n, plan.block_n), plan.splits)
    _quant_gemv_kernel[grid](
        x,
        qweight,
        words,
        scales,
        scale_outer,
        mins if mins is not None else scales,  # never read without HAS_MINS
        min_outer,
        target,
        num_rows,
        n,
        k,
        plan.steps_per_split,
        x.stride(0),
        qweight.stride(0),
        words.stride(0),
        scales.stride(0),
        scale_outer.stride(0),
        mins.stride(0) if mins is not None else 0,
        min_outer.stride(0),
        target.stride(-2),
        target.stride(0) if split else 0,
        BITS=bits,
        GROUP=group,
        OFFSET=offset,
        HAS_MINS=mins is not None,
        TWO_LEVEL=levels is not None,
        PER_OUTER=per_outer,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_C=plan.block_c,
        CHUNK_BYTES=plan.chunk_bytes,
        USE_DOT=plan.use_dot,
        SPLIT=split,
        num_warps=plan.num_warps,
    )
    if split:
        block = min(1024, triton.next_power_of_2(n))
        _sum_splits_kernel[(num_rows, triton.cdiv(n, block))](
            target, out, n, plan.splits, target.stride(0), target.stride(1), out.stride(0), BLOCK=block
        )
    return out


def quant_gemv_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    *,
    bits: int,
    group: int,
    offset: int = 0,
) -> torch.Tensor:
    """What quant_gemv computes, in float32 torch, cast to x's dtype."""
    q = (unpack_int4(qweight) if bits == 4 else qweight).float() - offset
    weight = q * scales.float().repeat_interleave(group, dim=1)
    if mins is not None:
        weight += mins.float().repeat_interleave(group, dim=1)
    return (x.float() @ weight.T).to(x.dtype)
