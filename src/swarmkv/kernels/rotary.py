"""Rotary position embedding (NeoX rotate-half) in one Triton launch for q and k, with the q/k RMSNorm
folded in and, optionally, k and v stored into the KV cache slabs: q and k are read in place through their
strides (views of the fused QKV output), so nothing is copied first."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from swarmkv.kernels.reference import apply_rotary as apply_rotary_reference
from swarmkv.kernels.reference import qk_norm_rotary as qk_norm_rotary_reference

__all__ = [
    "apply_rotary_",
    "apply_rotary_reference",
    "qk_norm_rotary_",
    "qk_norm_rotary_reference",
    "qk_norm_rotary_store",
]

# The most elements ((token, head) rows x padded head dim) one program holds: 8 rows of 128.
_TILE_ELEMENTS = 1024


@triton.jit
def _normed_heads(
    rows_ptr,
    weight_ptr,
    cols,
    partners,
    ok,
    partner_ok,
    col_ok,
    col_rot_ok,
    eps,
    HEAD_DIM: tl.constexpr,
    NORM: tl.constexpr,
):
    """Head rows (pointers [R, 1]) at cols [1, D] and at each col's rotary partner, each row RMS-normed when
    NORM, in float32."""
    x = tl.load(rows_ptr + cols, mask=ok, other=0.0)
    x_partner = tl.load(rows_ptr + partners, mask=partner_ok, other=0.0)
    if NORM:
        wide = x.to(tl.float32)
        scale = tl.rsqrt(tl.sum(wide * wide, axis=1) / HEAD_DIM + eps)[:, None]
        x = _scaled_by_weight(x, scale, weight_ptr, cols, col_ok)
        x_partner = _scaled_by_weight(x_partner, scale, weight_ptr, partners, col_rot_ok)
    return x.to(tl.float32), x_partner.to(tl.float32)


@triton.jit
def _scaled_by_weight(x, scale, weight_ptr, d, mask):
    """The weight at d times x * scale, in x's dtype, rounded as the reference rounds: the normed row to x's
    dtype, then its product with the weight."""
    weight = tl.load(weight_ptr + d, mask=mask, other=0.0)
    return (weight.to(tl.float32) * (x.to(tl.float32) * scale).to(x.dtype).to(tl.float32)).to(x.dtype)


@triton.jit
def _store_in_cache(cache_ptr, offset, x, scale, mask, FP8: tl.constexpr):
    """x into the cache slab at offset; an fp8 slab stores x / scale, saturated at e4m3's largest finite
    value."""
    if FP8:
        x = tl.clamp(x.to(tl.float32) / scale, -448.0, 448.0)
    tl.store(cache_ptr + offset, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rows_at_tokens(
    row, num_rows, num_heads, positions_ptr, cos_sin_ptr, table_kind_stride, table_position_stride, d, rot_ok
):
    """Rows [R] of a [T, heads] grid: each row's token (int64) and head, which rows are in the grid, and the cos
    and sin [R, D] at each row's position."""
    row_ok = row < num_rows
    token = (row // num_heads).to(tl.int64)
    position = tl.load(positions_ptr + token, mask=row_ok, other=0).to(tl.int64)
    table_ok = row_ok[:, None] & rot_ok
    cos_ptr = cos_sin_ptr + position[:, None] * table_position_stride + d
    # Both halves of the table are read, not just the first: the reference multiplies by the full row.
    cos = tl.load(cos_ptr, mask=table_ok, other=1.0).to(tl.float32)
    sin = tl.load(cos_ptr + table_kind_stride, mask=table_ok, other=0.0).to(tl.float32)
    return token, row % num_heads, row_ok, cos, sin


@triton.jit
def _qk_norm_rotary_kernel(
    positions_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    k_scale,
    v_scale,
    eps,
    q_token_stride,
    q_head_stride,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    cache_slot_stride,
    cache_head_stride,
    table_kind_stride,
    table_position_stride,
    num_tokens,
    num_q_heads,
    num_kv_heads,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    FP8: tl.constexpr,
):
    # A 1-D grid over BLOCK_R rows of (token, head) a program: first q's T x Hq rows, then k's T x Hkv (each k
    # row also carries its v head when storing); a program's rows are q's or k's, never both.
    block = tl.program_id(0)
    q_blocks = tl.cdiv(num_tokens * num_q_heads, BLOCK_R)
    d = tl.arange(0, BLOCK_D)[None, :]
    d_ok = d < HEAD_DIM
    half = ROTARY_DIM // 2
    rot_ok = d < ROTARY_DIM  # dims past the rotary part pass through (partial rotary)
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    if block < q_blocks:
        row = block * BLOCK_R + tl.arange(0, BLOCK_R)
        token, head, row_ok, cos, sin = _rows_at_tokens(
            row,
            num_tokens * num_q_heads,
            num_q_heads,
            positions_ptr,
            cos_sin_ptr,
            table_kind_stride,
            table_position_stride,
            d,
            rot_ok,
        )
        q_rows = q_ptr + token[:, None] * q_token_stride + head[:, None] * q_head_stride
        ok, partner_ok = row_ok[:, None] & d_ok, row_ok[:, None] & rot_ok
        x, x_partner = _normed_heads(
            q_rows, q_weight_ptr, d, partner, ok, partner_ok, d_ok, rot_ok, eps, HEAD_DIM, NORM
        )
        q_out = x * cos + sign * x_partner * sin
        tl.store(q_rows + d, q_out.to(q_ptr.dtype.element_ty), mask=ok)
    else:
        row = (block - q_blocks) * BLOCK_R + tl.arange(0, BLOCK_R)
        token, kv_head, row_ok, cos, sin = _rows_at_tokens(
            row,
            num_tokens * num_kv_heads,
            num_kv_heads,
            positions_ptr,
            cos_sin_ptr,
            table_kind_stride,
            table_position_stride,
            d,
            rot_ok,
        )
        k_rows = k_ptr + token[:, None] * k_token_stride + kv_head[:, None] * k_head_stride
        ok, partner_ok = row_ok[:, None] & d_ok, row_ok[:, None] & rot_ok
        x, x_partner = _normed_heads(
            k_rows, k_weight_ptr, d, partner, ok, partner_ok, d_ok, rot_ok, eps, HEAD_DIM, NORM
        )
        k_out = (x * cos + sign * x_partner * sin).to(k_ptr.dtype.element_ty)
        if STORE:
            slot = tl.load(slots_ptr + token, mask=row_ok, other=-1).to(tl.int64)[:, None]
            store_ok = ok & (slot >= 0)  # a negative slot is a padding row of a replayed graph
            v = tl.load(
                v_ptr + token[:, None] * v_token_stride + kv_head[:, None] * v_head_stride + d, mask=store_ok
            )
            cache_offset = slot * cache_slot_stride + kv_head[:, None] * cache_head_stride + d
            _store_in_cache(k_cache_ptr, cache_offset, k_out, k_scale, store_ok, FP8)
            _store_in_cache(v_cache_ptr, cache_offset, v, v_scale, store_ok, FP8)
        else:
            tl.store(k_rows + d, k_out, mask=ok)


def _launch(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float] | None,
) -> None:
    """Both public ops' checks and their one launch: with `cache` (slabs, slots, scales) None, k is rotated
    in place; else it is stored with v."""
    assert q.dim() == 3 and k.dim() == 3, "q and k must be [T, heads, D]"
    assert q.stride(2) == 1 and k.stride(2) == 1, "q and k must have a contiguous last dim"
    assert q.dtype == k.dtype, f"q dtype {q.dtype} differs from k dtype {k.dtype}"
    num_tokens, num_q_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim, "k must match q in tokens and head dim"
    assert positions.shape == (num_tokens,), "positions must be [T]"
    rotary_dim = cos_sin.shape[2]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim, "rotate-half needs an even rotary dim <= head dim"
    assert cos_sin.dim() == 3 and cos_sin.shape[0] == 2 and cos_sin.stride(2) == 1
    assert (q_weight is None) == (k_weight is None), "q and k are normed together or not at all"
    for weight in (q_weight, k_weight):
        assert weight is None or (weight.shape == (head_dim,) and weight.is_contiguous())
        assert weight is None or weight.dtype == q.dtype, "a norm weight must have q's dtype"
    num_kv_heads = k.shape[1]
    if num_tokens == 0 or num_q_heads + num_kv_heads == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    # A program takes up to a tile of (token, head) rows: a few of a large model's heads, or a whole small
    # model's launch; the interpreter's cost is per program and op, not per element.
    most_rows = num_tokens * max(num_q_heads, num_kv_heads)
    block_r = min(triton.next_power_of_2(most_rows), max(1, _TILE_ELEMENTS // block_d))
    row_blocks = triton.cdiv(num_tokens * num_q_heads, block_r) + triton.cdiv(
        num_tokens * num_kv_heads, block_r
    )
    # Unused pointers (no norm, no store) point at q: the kernel never reads them.
    k_cache, v_cache, slots, k_scale, v_scale = cache or (q, q, positions, 1.0, 1.0)
    _qk_norm_rotary_kernel[(row_blocks,)](
        positions,
        q,
        k,
        v,
        q if q_weight is None else q_weight,
        q if k_weight is None else k_weight,
        cos_sin,
        k_cache,
        v_cache,
        slots,
        k_scale,
        v_scale,
        eps,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        cos_sin.stride(0),
        cos_sin.stride(1),
        num_tokens,
        num_q_heads,
        num_kv_heads,
        HEAD_DIM=head_dim,
        ROTARY_DIM=rotary_dim,
        BLOCK_D=block_d,
        BLOCK_R=block_r,
        NORM=q_weight is not None,
        STORE=cache is not None,
        FP8=cache is not None and k_cache.dtype == torch.float8_e4m3fn,
    )


def qk_norm_rotary_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMS-norm each head of q [T, Hq, D] and k [T, Hkv, D] (when weights are given), then rotate the first
    R dims by the cos/sin rows [2, P, R] at positions [T], all in place and in one launch; returns (q, k),
    as torch's in-place ops return their tensor, so it serves where `reference.qk_norm_rotary` does."""
    _launch(positions, q, k, k, cos_sin, q_weight, k_weight, eps, None)
    return q, k


def qk_norm_rotary_store(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos_sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """qk_norm_rotary_ on q in place (returned), and the normed, rotated k with v [T, Hkv, D] written into
    one layer's cache slabs [slots, Hkv, D] at `slots` [T] (negative: skipped) as kernels/attention.py's
    store_kv writes them; k itself is left as it was. One launch."""
    assert v.shape == k.shape and v.stride(2) == 1 and v.dtype == k.dtype, "v must match k"
    assert k_cache.stride(2) == 1 and k_cache.stride() == v_cache.stride(), "cache slabs must match"
    assert k_cache.shape[1:] == k.shape[1:] and slots.shape == positions.shape
    _launch(positions, q, k, v, cos_sin, q_weight, k_weight, eps, (k_cache, v_cache, slots, k_scale, v_scale))
    return q


def apply_rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by the cos/sin rows [2, P, D] at positions [T]."""
    qk_norm_rotary_(positions, q, k, cos_sin, None, None, 0.0)
