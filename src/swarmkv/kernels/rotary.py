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


@triton.jit
def _normed_head(
    head_ptr, weight_ptr, d, partner, d_ok, rot_ok, eps, HEAD_DIM: tl.constexpr, NORM: tl.constexpr
):
    """A head's row at d and at each d's rotary partner, RMS-normed when NORM, in float32."""
    x = tl.load(head_ptr + d, mask=d_ok, other=0.0)
    x_partner = tl.load(head_ptr + partner, mask=rot_ok, other=0.0)
    if NORM:
        wide = x.to(tl.float32)
        scale = tl.rsqrt(tl.sum(wide * wide, axis=0) / HEAD_DIM + eps)
        x = _scaled_by_weight(x, scale, weight_ptr, d, d_ok)
        x_partner = _scaled_by_weight(x_partner, scale, weight_ptr, partner, rot_ok)
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
    num_q_heads,
    HEAD_DIM: tl.constexpr,
    ROTARY_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    FP8: tl.constexpr,
):
    # Grid (T, Hq + Hkv): heads [0, Hq) are q's, the rest k's (each also carries its v head when storing).
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos_ptr = cos_sin_ptr + position * table_position_stride
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    half = ROTARY_DIM // 2
    rot_ok = d < ROTARY_DIM  # dims past the rotary part pass through (partial rotary)
    partner = tl.where(d < half, d + half, d - half)
    # Both halves of the table are read, not just the first: the reference multiplies by the full row.
    cos = tl.load(cos_ptr + d, mask=rot_ok, other=1.0).to(tl.float32)
    sin = tl.load(cos_ptr + table_kind_stride + d, mask=rot_ok, other=0.0).to(tl.float32)
    sign = tl.where(d < half, -1.0, 1.0)
    if head < num_q_heads:
        q_head_ptr = q_ptr + token * q_token_stride + head * q_head_stride
        x, x_partner = _normed_head(q_head_ptr, q_weight_ptr, d, partner, d_ok, rot_ok, eps, HEAD_DIM, NORM)
        q_out = x * cos + sign * x_partner * sin
        tl.store(q_head_ptr + d, q_out.to(q_ptr.dtype.element_ty), mask=d_ok)
    else:
        kv_head = head - num_q_heads
        k_head_ptr = k_ptr + token * k_token_stride + kv_head * k_head_stride
        x, x_partner = _normed_head(k_head_ptr, k_weight_ptr, d, partner, d_ok, rot_ok, eps, HEAD_DIM, NORM)
        k_out = (x * cos + sign * x_partner * sin).to(k_ptr.dtype.element_ty)
        if STORE:
            slot = tl.load(slots_ptr + token).to(tl.int64)
            store_ok = d_ok & (slot >= 0)  # a negative slot is a padding row of a replayed graph
            v = tl.load(v_ptr + token * v_token_stride + kv_head * v_head_stride + d, mask=store_ok)
            cache_offset = slot * cache_slot_stride + kv_head * cache_head_stride + d
            _store_in_cache(k_cache_ptr, cache_offset, k_out, k_scale, store_ok, FP8)
            _store_in_cache(v_cache_ptr, cache_offset, v, v_scale, store_ok, FP8)
        else:
            tl.store(k_head_ptr + d, k_out, mask=d_ok)


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
    num_heads = num_q_heads + k.shape[1]
    if num_tokens == 0 or num_heads == 0:
        return
    # Unused pointers (no norm, no store) point at q: the kernel never reads them.
    k_cache, v_cache, slots, k_scale, v_scale = cache or (q, q, positions, 1.0, 1.0)
    _qk_norm_rotary_kernel[(num_tokens, num_heads)](
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
        num_q_heads,
        HEAD_DIM=head_dim,
        ROTARY_DIM=rotary_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
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
