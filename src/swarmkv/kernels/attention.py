"""Paged attention in Triton: the KV store into pages, query tiles attending over a page-table row, and the
exact log-sum-exp merge of partial results.

One attention kernel serves every case, driven by a table of tiles. A tile is a run of query tokens (rows
`q_start .. q_start + q_count` of the step's flat batch) that read the same page-table row over key positions
`[kv_start, kv_end)`; query `j` of the tile sits at position `q_pos0 + j` and sees keys at or before it.
- extend (prefill over a cached prefix): a chunk's tokens against their own row, causal, output written directly;
- decode: one token against its own row, split over the keys (flash-decoding), partials merged afterwards;
- shared-prefix decode (cascade, Hydragen): the tokens of a group's members against the leader's row over
  the pages they all hold, so each shared page is read once per tile of members, not once per member;
  its partials are merged with each member's own decode partials, in float32.
A program handles one tile, one KV head and one key split; its rows are (token, query head of that KV
head) pairs, so grouped-query heads share every key load. Nothing assumes a warp width: the kernels are
plain Triton and run on NVIDIA and AMD alike.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_FIELDS = 7  # q_start, q_count, table_row, kv_start, kv_end, q_pos0, column
NOT_CAUSAL = 1 << 30  # q_pos0 of a tile whose queries see every key of its range
BLOCK_N = 32  # keys per inner iteration
MIN_ROWS = 16  # tl.dot needs at least 16 rows on some targets
MAX_COLUMNS = 32  # partial columns a merge combines (splits of the shared prefix plus the own keys)


def tile_tokens(group: int, tokens: int) -> int:
    """Query tokens per tile for `group` heads per KV head: at least `tokens`, and at least MIN_ROWS rows."""
    group_pad = triton.next_power_of_2(group)
    return max(triton.next_power_of_2(tokens), -(-MIN_ROWS // group_pad))


@triton.jit
def _store_kv_kernel(
    K,
    V,
    KCache,
    VCache,
    Slots,
    k_scale,
    v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cs,
    stride_ch,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + token).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # a negative slot is a padding row of a replayed graph: nothing to store
    mask = (h < NUM_HEADS) & (d < HEAD_DIM) & (slot >= 0)
    k = tl.load(K + token * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(V + token * stride_vt + h * stride_vh + d, mask=mask)
    if FP8:  # stored = value / scale, saturated at e4m3's largest finite value
        k = tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
    tl.store(KCache + slot * stride_cs + h * stride_ch + d, k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + slot * stride_cs + h * stride_ch + d, v.to(VCache.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write the new tokens' k, v [T, Hkv, D] into one layer's cache slabs [slots, Hkv, D] at `slots` [T]
    (rows with a negative slot are skipped); an fp8 cache stores k / k_scale and v / v_scale."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1 and k_cache.stride(2) == 1
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slots,
        k_scale,
        v_scale,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=k_cache.dtype == torch.float8_e4m3fn,
    )


def store_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """What store_kv does, in torch."""
    keep = slots >= 0
    if k_cache.dtype == torch.float8_e4m3fn:
        k = (k.float() / k_scale).clamp(-448, 448).to(k_cache.dtype)
        v = (v.float() / v_scale).clamp(-448, 448).to(v_cache.dtype)
    k_cache[slots[keep]] = k[keep]
    v_cache[slots[keep]] = v[keep]


@triton.jit(do_not_specialize=["part_row0", "num_splits"])
def _attention_kernel(
    Q,
    K,
    V,
    Out,
    PartOut,
    PartLse,
    Table,
    Tiles,
    sm_scale,
    v_scale,
    part_row0,
    num_splits,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_pc,
    stride_lt,
    stride_lh,
    stride_table,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    TOKENS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    PARTIAL: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    fields = Tiles + tile * 7
    q_start = tl.load(fields + 0)
    q_count = tl.load(fields + 1)
    table_row = tl.load(fields + 2).to(tl.int64)
    kv_start = tl.load(fields + 3)
    kv_end = tl.load(fields + 4)
    q_pos0 = tl.load(fields + 5)
    column = tl.load(fields + 6)

    rows = tl.arange(0, TOKENS * GROUP_PAD)
    token = rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (token < q_count) & (rows % GROUP_PAD < GROUP)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_pos = q_pos0 + token

    # A causal tile never reads past its last query; the rest of the range splits into BLOCK_N-aligned parts.
    hi_all = tl.minimum(kv_end, q_pos0 + q_count)
    span = tl.maximum(hi_all - kv_start, 0)
    per_split = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
    lo = kv_start + split * per_split
    hi = tl.minimum(lo + per_split, hi_all)

    top = tl.full([TOKENS * GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([TOKENS * GROUP_PAD], tl.float32)
    acc = tl.zeros([TOKENS * GROUP_PAD, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        key_ok = pos < hi
        page = tl.load(Table + table_row * stride_table + pos // PAGE_SIZE, mask=key_ok, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(K + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        k = k.to(q.dtype)  # an fp8 cache: its scale is folded into sm_scale
        # "ieee": float32 stays exact (no tf32), and it is the one precision every target accepts.
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        allowed = key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(allowed, scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        safe_top = tl.where(new_top == float("-inf"), 0.0, new_top)  # a row that has seen no key yet
        weights = tl.exp(scores - safe_top[:, None])
        rescale = tl.exp(top - safe_top)
        total = total * rescale + tl.sum(weights, 1)
        v = tl.load(V + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :], mask=kv_mask, other=0.0)
        v = v.to(q.dtype)
        acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision="ieee")
        top = new_top

    seen = total > 0
    out = acc * (v_scale / tl.where(seen, total, 1.0))[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    if PARTIAL:
        part_rows = q_rows - part_row0
        col = column + split
        lse = tl.where(seen, top + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
        tl.store(
            PartOut
            + part_rows[:, None] * stride_pt
            + head[:, None] * stride_ph
            + col * stride_pc
            + d[None, :],
            out,
            mask=out_mask,
        )
        tl.store(PartLse + part_rows * stride_lt + head * stride_lh + col, lse, mask=row_ok)
    else:
        tl.store(
            Out + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=out_mask,
        )


@triton.jit(do_not_specialize=["out_row0", "num_columns"])
def _merge_kernel(
    PartOut,
    PartLse,
    Out,
    out_row0,
    num_columns,
    stride_pt,
    stride_ph,
    stride_pc,
    stride_lt,
    stride_lh,
    stride_ot,
    stride_oh,
    BLOCK_C: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    c = tl.arange(0, BLOCK_C)
    c_ok = c < num_columns
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    lse = tl.load(PartLse + row * stride_lt + head * stride_lh + c, mask=c_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weights = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))
    # An unwritten column weighs 0 and is never read: its memory is uninitialised, maybe NaN.
    written = c_ok & (lse > float("-inf"))
    parts = tl.load(
        PartOut + row * stride_pt + head * stride_ph + c[:, None] * stride_pc + d[None, :],
        mask=written[:, None] & d_ok[None, :],
        other=0.0,
    )
    total = tl.sum(weights, 0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0, total, 1.0)
    out_row = out_row0 + row
    tl.store(Out + out_row * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


def attend_tiles(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    tiles: torch.Tensor,
    *,
    page_size: int,
    tokens_per_tile: int,
    out: torch.Tensor | None = None,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,
    part_row0: int = 0,
    num_splits: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Run every tile of `tiles` [N, TILE_FIELDS] (int32 or int64) for queries q [T, Hq, D] over the cache
    slabs [slots, Hkv, D] through page table `table` [rows, pages]. Without `partials`, write normalised
    outputs into `out` [T, Hq, D] (one split). With `partials` (out [R, Hq, C, D] float32, lse [R, Hq, C]
    float32, rows counted from `part_row0`), write each split's normalised output and log-sum-exp at
    column `column + split` of the tile's rows. An fp8 cache's values are multiplied by k_scale, v_scale."""
    num_tiles = tiles.shape[0]
    if num_tiles == 0:
        return
    _, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and k_cache.stride() == v_cache.stride()
    if partials is None:
        assert out is not None and num_splits == 1
        part_out, part_lse = out, out  # unused by the kernel when PARTIAL is off
        p_strides = (0, 0, 0, 0, 0)
    else:
        part_out, part_lse = partials
        p_strides = (
            part_out.stride(0),
            part_out.stride(1),
            part_out.stride(2),
            part_lse.stride(0),
            part_lse.stride(1),
        )
        out = part_out
    _attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_lse,
        table,
        tiles,
        head_dim**-0.5 * k_scale,
        v_scale,
        part_row0,
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        out.stride(0),
        out.stride(1),
        *p_strides,
        table.stride(0),
        GROUP=group,
        GROUP_PAD=triton.next_power_of_2(group),
        TOKENS=tokens_per_tile,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=BLOCK_N,
        PAGE_SIZE=page_size,
        PARTIAL=partials is not None,
        # wide tiles need the registers of 8 warps (a 128 x 128 float32 accumulator)
        num_warps=8 if tokens_per_tile * triton.next_power_of_2(group) >= 64 else 4,
    )


def merge_partials(
    part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, out_row0: int, num_columns: int
) -> None:
    """Combine the first `num_columns` partials [R, Hq, C, D] of each row by their log-sum-exps into
    out[out_row0 + r] (a row with no partial gets zeros)."""
    num_rows, num_heads, _, head_dim = part_out.shape
    if num_rows == 0:
        return
    assert num_columns <= MAX_COLUMNS
    _merge_kernel[(num_rows, num_heads)](
        part_out,
        part_lse,
        out,
        out_row0,
        num_columns,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_C=MAX_COLUMNS,  # fixed, so the merge compiles once whatever the split count
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def attend_tiles_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    tiles: torch.Tensor,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tile's rows of output [T, Hq, D] and their log-sum-exp [T, Hq], in float32 torch (rows no tile
    covers stay 0 and -inf)."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // k_cache.shape[1]
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for q_start, q_count, row, kv_start, kv_end, q_pos0, _ in tiles.tolist():
        if q_count == 0 or kv_end <= kv_start:
            continue
        pos = torch.arange(kv_start, kv_end, device=q.device)
        slots = table[row, pos // page_size].long() * page_size + pos % page_size
        keys = k_cache[slots].float().repeat_interleave(group, dim=1)  # [S, Hq, D]
        values = v_cache[slots].float().repeat_interleave(group, dim=1)
        query = q[q_start : q_start + q_count].float()  # [n, Hq, D]
        scores = torch.einsum("nhd,shd->nhs", query, keys) * head_dim**-0.5
        q_pos = q_pos0 + torch.arange(q_count, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[:, None, None], float("-inf"))
        lse[q_start : q_start + q_count] = torch.logsumexp(scores, -1)
        out[q_start : q_start + q_count] = torch.einsum("nhs,shd->nhd", scores.softmax(-1), values)
    return out, lse
