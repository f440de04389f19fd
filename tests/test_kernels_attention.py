"""The Triton paged-attention kernels against their torch references (interpreted on the CPU)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from swarmkv.kernels.attention import (  # noqa: E402
    NOT_CAUSAL,
    attend_tiles,
    attend_tiles_reference,
    merge_partials,
    store_kv,
    store_kv_reference,
    tile_tokens,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE = 4


def _cache(num_pages: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_pages * PAGE, kv_heads, dim)
    k = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    v = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    return k, v


def _table(rows: list[list[int]], width: int) -> torch.Tensor:
    table = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, pages in enumerate(rows):
        table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    return table.to(DEVICE)


def _tiles(rows: list[tuple[int, int, int, int, int, int, int]]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE).reshape(-1, 7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_writes_only_real_slots(dtype: torch.dtype) -> None:
    k_cache, v_cache = (torch.zeros(32, 3, 8, dtype=dtype, device=DEVICE) for _ in range(2))
    k = torch.randn(5, 3, 8).to(DEVICE, dtype)
    v = torch.randn(5, 3, 8).to(DEVICE, dtype)
    slots = torch.tensor([7, 0, -1, 31, 12], device=DEVICE)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    store_kv_reference(k, v, ref_k, ref_v, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 4  # the padding row (-1) wrote nothing


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (6, 2, 24), (2, 2, 32)])
def test_extend_tiles_match_reference(heads: int, kv_heads: int, dim: int) -> None:
    """Chunks over a cached prefix: causal, pages out of order, a chunk split over several tiles."""
    k_cache, v_cache = _cache(16, kv_heads, dim, torch.float32)
    table = _table([[5, 2, 9, 0, 11], [3, 14, 7]], 8)
    tokens = tile_tokens(heads // kv_heads, 4)
    # request 0: positions 6..13 (8 tokens, prefix of 6 cached); request 1: positions 0..4 (a fresh prompt)
    q = torch.randn(13, heads, dim, device=DEVICE)
    tiles = []
    for q_start, count, row, first in ((0, 8, 0, 6), (8, 5, 1, 0)):
        for off in range(0, count, tokens):
            n = min(tokens, count - off)
            tiles.append((q_start + off, n, row, 0, first + count, first + off, -1))
    out = torch.zeros_like(q)
    attend_tiles(q, k_cache, v_cache, table, _tiles(tiles), page_size=PAGE, tokens_per_tile=tokens, out=out)
    ref, _ = attend_tiles_reference(q, k_cache, v_cache, table, _tiles(tiles), PAGE)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_decode_merges_to_reference(num_splits: int, dtype: torch.dtype) -> None:
    heads, kv_heads, dim = 4, 2, 16
    k_cache, v_cache = _cache(24, kv_heads, dim, dtype)
    table = _table([[4, 1, 8, 3, 20, 6, 7, 9, 10, 11], [2, 5], [12, 13, 14, 15, 16, 17, 18, 19, 0, 21]], 12)
    lengths = [37, 5, 40]  # the decoded token is the last position of each
    q = torch.randn(3, heads, dim).to(DEVICE, dtype)
    tiles = _tiles([(i, 1, i, 0, n, n - 1, 0) for i, n in enumerate(lengths)])
    part_out = torch.zeros(3, heads, num_splits, dim, device=DEVICE)
    part_lse = torch.full((3, heads, num_splits), float("-inf"), device=DEVICE)
    tokens = tile_tokens(heads // kv_heads, 1)
    attend_tiles(
        q,
        k_cache,
        v_cache,
        table,
        tiles,
        page_size=PAGE,
        tokens_per_tile=tokens,
        partials=(part_out, part_lse),
        num_splits=num_splits,
    )
    out = torch.zeros_like(q)
    merge_partials(part_out, part_lse, out, 0, num_splits)
    ref, _ = attend_tiles_reference(q, k_cache, v_cache, table, tiles, PAGE)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


def test_cascade_decode_reads_the_prefix_through_the_leader() -> None:
    """Three decodes sharing 3 pages: the prefix tile reads the leader's row once for all of them, each
    decode reads only its own suffix, and the merge equals plain attention over each whole row."""
    heads, kv_heads, dim, splits = 8, 2, 16, 2
    k_cache, v_cache = _cache(24, kv_heads, dim, torch.float32)
    shared = [9, 3, 17]
    table = _table([shared + [1, 2], shared + [4], [0] * 3 + [5, 6, 7]], 8)  # row 2's prefix is bogus
    lengths = [19, 14, 23]
    q = torch.randn(3, heads, dim, device=DEVICE)
    row_of = [0, 1, 2]
    prefix_tiles = _tiles([(0, 3, 0, 0, 3 * PAGE, NOT_CAUSAL, 0)])
    # row 2 borrows the leader's prefix: its own table's first pages are never read
    decode_tiles = _tiles([(i, 1, row_of[i], 3 * PAGE, n, n - 1, splits) for i, n in enumerate(lengths)])
    part_out = torch.zeros(3, heads, 2 * splits, dim, device=DEVICE)
    part_lse = torch.full((3, heads, 2 * splits), float("-inf"), device=DEVICE)
    group = heads // kv_heads
    for tiles, tokens in ((prefix_tiles, tile_tokens(group, 3)), (decode_tiles, tile_tokens(group, 1))):
        attend_tiles(
            q,
            k_cache,
            v_cache,
            table,
            tiles,
            page_size=PAGE,
            tokens_per_tile=tokens,
            partials=(part_out, part_lse),
            num_splits=splits,
        )
    out = torch.zeros_like(q)
    merge_partials(part_out, part_lse, out, 0, 2 * splits)
    true_table = _table([shared + [1, 2], shared + [4], shared + [5, 6, 7]], 8)
    whole = _tiles([(i, 1, i, 0, n, n - 1, 0) for i, n in enumerate(lengths)])
    ref, _ = attend_tiles_reference(q, k_cache, v_cache, true_table, whole, PAGE)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_merge_ignores_unwritten_columns_and_empty_rows() -> None:
    part_out = torch.randn(2, 2, 3, 8, device=DEVICE)
    part_out[:, :, 1] = float("nan")  # unwritten partials are uninitialised memory
    part_out[1] = float("nan")
    part_lse = torch.tensor([[[0.5, float("-inf"), 1.5]] * 2, [[float("-inf")] * 3] * 2], device=DEVICE)
    out = torch.full((4, 2, 8), 7.0, device=DEVICE)
    merge_partials(part_out, part_lse, out, 1, 3)
    weights = torch.softmax(torch.tensor([0.5, 1.5]), 0).to(DEVICE)
    expected = weights[0] * part_out[0, :, 0] + weights[1] * part_out[0, :, 2]
    torch.testing.assert_close(out[1], expected)
    assert torch.equal(out[2], torch.zeros(2, 8, device=DEVICE))  # no partial: zeros, not NaN
    assert torch.equal(out[0], torch.full((2, 8), 7.0, device=DEVICE))  # rows before out_row0 untouched


def test_fp8_cache_is_stored_scaled_and_read_back_descaled() -> None:
    """Store into an fp8 cache (value / scale), then attend over it: the kernels de-scale K through the
    softmax scale and V at the output, matching attention over the de-scaled cache."""
    heads, kv_heads, dim, k_scale, v_scale = 4, 2, 16, 2.0**-6, 2.0**-7
    fp8 = torch.float8_e4m3fn
    k_cache = torch.zeros(16 * PAGE, kv_heads, dim, dtype=fp8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    # Values e4m3 holds exactly, over power-of-two scales: the store must reproduce them bit for bit. (Triton's
    # interpreter rounds e4m3 wrongly where a value rounds up into the next binade; GPUs do not.)
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(13, kv_heads, dim, generator=gen) * 60).to(fp8).float().to(DEVICE) * k_scale
    v = (torch.randn(13, kv_heads, dim, generator=gen) * 60).to(fp8).float().to(DEVICE) * v_scale
    slots = torch.arange(13, device=DEVICE) + 2 * PAGE
    store_kv(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv_reference(k, v, ref_k, ref_v, slots, k_scale, v_scale)
    assert torch.equal(k_cache.float(), ref_k.float()) and torch.equal(v_cache.float(), ref_v.float())
    assert torch.equal(k_cache[slots].float() * k_scale, k)
    table = _table([[2, 3, 4, 5]], 8)
    q = torch.randn(2, heads, dim, device=DEVICE)
    tiles = _tiles([(0, 2, 0, 0, 13, 11, -1)])
    out = torch.zeros_like(q)
    tokens = tile_tokens(heads // kv_heads, 2)
    attend_tiles(
        q, k_cache, v_cache, table, tiles, page_size=PAGE, tokens_per_tile=tokens, out=out,
        k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    descaled_k, descaled_v = k_cache.float() * k_scale, v_cache.float() * v_scale
    ref, _ = attend_tiles_reference(q, descaled_k, descaled_v, table, tiles, PAGE)
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
