"""Triton RMSNorm, rotary (with the q/k norm and the KV store fused in) and SwiGLU kernels (alone and fused
into the gate-up matmul) against their torch references (CPU under the interpreter)."""

from __future__ import annotations

import os

import pytest
import torch

# The interpreter must be chosen before the kernels are decorated, i.e. before swarmkv.kernels is imported;
# on a GPU machine the same tests run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from swarmkv.kernels.activation import (  # noqa: E402
    gate_up_silu,
    gate_up_silu_reference,
    silu_and_mul,
    silu_and_mul_reference,
)
from swarmkv.kernels.attention import store_kv, store_kv_reference  # noqa: E402
from swarmkv.kernels.norm import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from swarmkv.kernels.rotary import (  # noqa: E402
    apply_rotary_,
    apply_rotary_reference,
    qk_norm_rotary_,
    qk_norm_rotary_reference,
    qk_norm_rotary_store,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 1e-6
# Non-monotonic, with a repeat, so a kernel that reads position = token index fails.
POSITIONS = [7, 0, 3, 3, 12]
MAX_POSITIONS = 16


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=generator)).to(DEVICE)


def _tolerance(dtype: torch.dtype, input_scale: float) -> dict[str, float]:
    # A few ulps of the dtype, relative to the output and to the inputs' magnitude: the references
    # round intermediates to the dtype where the kernels round once, and the interpreter truncates
    # float32 -> bfloat16 instead of rounding to nearest. float32 gets 1e-6 (8 ulps) because GPU exp,
    # rsqrt and division are a few ulps off. A wrong half, position or eps is far outside.
    rtol = max(4 * torch.finfo(dtype).eps, 1e-6)
    return {"rtol": rtol, "atol": rtol * input_scale}


def _assert_mismatch(actual: torch.Tensor, expected: torch.Tensor, tolerance: dict[str, float]) -> None:
    with pytest.raises(AssertionError):
        torch.testing.assert_close(actual, expected, **tolerance)


def _strided_rows(
    num_tokens: int, width: int, dtype: torch.dtype, seed: int, scale: float = 1.0, pad: int = 32
) -> torch.Tensor:
    # A column slice of a wider tensor: rows have a stride larger than their width.
    wide = _randn(num_tokens, width + pad, seed=seed, scale=scale).to(dtype)
    return wide[:, :width]


def _cos_sin(head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(MAX_POSITIONS, dtype=torch.float32), inv_freq.float())
    angles = torch.cat([angles, angles], dim=-1)
    return torch.stack([angles.cos(), angles.sin()]).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [64, 96])
@pytest.mark.parametrize("num_tokens", [1, 5, 37])  # 37 rows: several programs, the last part-full
def test_rms_norm_matches_reference(num_tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
    x = _strided_rows(num_tokens, hidden_size, dtype, seed=1)
    weight = (1 + _randn(hidden_size, seed=2, scale=0.2)).to(dtype)
    out = rms_norm(x, weight, EPS)
    assert out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, rms_norm_reference(x, weight, EPS), **_tolerance(dtype, 4.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden_size", [64, 96])
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_add_rms_norm_matches_reference(num_tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
    x = _strided_rows(num_tokens, hidden_size, dtype, seed=3)
    # A different row stride from x's, so mixing up the two strides fails.
    residual = _strided_rows(num_tokens, hidden_size, dtype, seed=4, pad=16)
    weight = (1 + _randn(hidden_size, seed=5, scale=0.2)).to(dtype)
    residual_before = residual.clone()
    out, summed = add_rms_norm(x, residual, weight, EPS)
    expected_out, expected_summed = add_rms_norm_reference(x, residual, weight, EPS)
    # The sum is one rounding of an exact value: within one ulp (exact wherever rounding is to nearest).
    torch.testing.assert_close(summed, expected_summed, rtol=torch.finfo(dtype).eps, atol=0.0)
    torch.testing.assert_close(out, expected_out, **_tolerance(dtype, 4.0))
    assert torch.equal(residual, residual_before)


def test_norms_reject_a_different_eps() -> None:
    # Small activations make eps matter; a kernel that ignored or misread eps would pass without this.
    x = _strided_rows(5, 96, torch.float32, seed=6, scale=0.01)
    residual = _strided_rows(5, 96, torch.float32, seed=7, scale=0.01)
    weight = 1 + _randn(96, seed=8, scale=0.2)
    tolerance = _tolerance(torch.float32, 4.0)
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 1e-5), **tolerance)
    _assert_mismatch(rms_norm(x, weight, 1e-5), rms_norm_reference(x, weight, 2e-5), tolerance)
    out, _ = add_rms_norm(x, residual, weight, 1e-5)
    _assert_mismatch(out, add_rms_norm_reference(x, residual, weight, 2e-5)[0], tolerance)


def _fused_qkv(
    num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    qkv = _randn(num_tokens, width, seed=9, scale=1.5).to(dtype)
    q, k, _ = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return qkv, q.view(num_tokens, num_q_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64, 96])
@pytest.mark.parametrize("positions", [[5], POSITIONS])
def test_rotary_rotates_views_of_fused_qkv_in_place(
    positions: list[int], head_dim: int, dtype: torch.dtype
) -> None:
    num_tokens, num_q_heads, num_kv_heads = len(positions), 4, 2
    qkv, q, k = _fused_qkv(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype)
    assert not q.is_contiguous() or num_tokens == 1
    v_before = qkv[:, (num_q_heads + num_kv_heads) * head_dim :].clone()
    position_ids = torch.tensor(positions, dtype=torch.int64, device=DEVICE)
    cos_sin = _cos_sin(head_dim)
    expected_q, expected_k = apply_rotary_reference(position_ids, q, k, cos_sin)
    apply_rotary_(position_ids, q, k, cos_sin)
    tolerance = _tolerance(dtype, 6.0)
    torch.testing.assert_close(q, expected_q, **tolerance)
    torch.testing.assert_close(k, expected_k, **tolerance)
    assert torch.equal(qkv[:, (num_q_heads + num_kv_heads) * head_dim :], v_before)


def test_rotary_rotates_separate_q_and_k() -> None:
    # q and k from different tensors, k taking every other head: token and head strides both differ
    # from q's, unlike views of one qkv row.
    q = _randn(len(POSITIONS), 4, 64, seed=12)
    k_every_other_head = _randn(len(POSITIONS), 4, 64, seed=13)
    k = k_every_other_head[:, ::2]
    skipped_heads_before = k_every_other_head[:, 1::2].clone()
    position_ids = torch.tensor(POSITIONS, dtype=torch.int64, device=DEVICE)
    cos_sin = _cos_sin(64)
    expected_q, expected_k = apply_rotary_reference(position_ids, q, k, cos_sin)
    apply_rotary_(position_ids, q, k, cos_sin)
    tolerance = _tolerance(torch.float32, 6.0)
    torch.testing.assert_close(q, expected_q, **tolerance)
    torch.testing.assert_close(k, expected_k, **tolerance)
    assert torch.equal(k_every_other_head[:, 1::2], skipped_heads_before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_rejects_wrong_positions_and_swapped_halves(dtype: torch.dtype) -> None:
    head_dim = 64
    _, q, k = _fused_qkv(len(POSITIONS), 4, 2, head_dim, dtype)
    position_ids = torch.tensor(POSITIONS, dtype=torch.int64, device=DEVICE)
    cos_sin = _cos_sin(head_dim)
    # Rotating the other way round is what a swapped pair of halves computes.
    backwards = torch.stack([cos_sin[0], -cos_sin[1]])
    wrong_position_q, wrong_position_k = apply_rotary_reference(position_ids + 1, q, k, cos_sin)
    backwards_q, backwards_k = apply_rotary_reference(position_ids, q, k, backwards)
    apply_rotary_(position_ids, q, k, cos_sin)
    tolerance = _tolerance(dtype, 6.0)
    for wrong_q, wrong_k in [(wrong_position_q, wrong_position_k), (backwards_q, backwards_k)]:
        _assert_mismatch(q, wrong_q, tolerance)
        _assert_mismatch(k, wrong_k, tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate_size", [64, 96, 1100])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_silu_and_mul_matches_reference(num_tokens: int, intermediate_size: int, dtype: torch.dtype) -> None:
    # 1100 columns span two programs of 1024; a stride wider than 2I checks row addressing.
    gate_up = _strided_rows(num_tokens, 2 * intermediate_size, dtype, seed=10, scale=3.0)
    out = silu_and_mul(gate_up)
    assert out.shape == (num_tokens, intermediate_size) and out.dtype == dtype and out.is_contiguous()
    torch.testing.assert_close(out, silu_and_mul_reference(gate_up), **_tolerance(dtype, 1.0))


def test_silu_and_mul_rejects_swapped_gate_and_up() -> None:
    gate_up = _strided_rows(5, 192, torch.bfloat16, seed=11, scale=3.0)
    swapped = torch.cat(gate_up.chunk(2, dim=-1)[::-1], dim=-1)
    _assert_mismatch(silu_and_mul(gate_up), silu_and_mul_reference(swapped), _tolerance(torch.bfloat16, 1.0))


def _qkv_heads(
    num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, gated: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv and its q, k, v head views; gated, each q head is followed by its gate, as Qwen3.5 lays them out."""
    q_width = num_q_heads * head_dim * (2 if gated else 1)
    width = q_width + 2 * num_kv_heads * head_dim
    qkv = _randn(num_tokens, width, seed=14, scale=1.5).to(dtype)
    q, k, v = qkv.split([q_width, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    if gated:
        q = q.view(num_tokens, num_q_heads, 2 * head_dim)[..., :head_dim]
    else:
        q = q.view(num_tokens, num_q_heads, head_dim)
    heads = (num_tokens, num_kv_heads, head_dim)
    return qkv, q, k.view(heads), v.view(heads)


def _norm_weights(head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (1 + _randn(head_dim, seed=15, scale=0.3)).to(dtype), (
        1 + _randn(head_dim, seed=16, scale=0.3)
    ).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("head_dim", "rotary_dim", "normed", "gated"),
    [(16, 16, True, False), (64, 64, False, False), (96, 96, True, False), (64, 32, True, True)],
)
def test_qk_norm_rotary_matches_reference_on_views_of_qkv(
    head_dim: int, rotary_dim: int, normed: bool, gated: bool, dtype: torch.dtype
) -> None:
    """Normed (or not), fully or partially rotated, q heads packed or interleaved with their gates: no copy first."""
    qkv, q, k, _ = _qkv_heads(len(POSITIONS), 4, 2, head_dim, dtype, gated)
    before = qkv.clone()
    q_weight, k_weight = _norm_weights(head_dim, dtype) if normed else (None, None)
    position_ids = torch.tensor(POSITIONS, dtype=torch.int64, device=DEVICE)
    cos_sin = _cos_sin(rotary_dim)
    expected_q, expected_k = qk_norm_rotary_reference(position_ids, q, k, cos_sin, q_weight, k_weight, EPS)
    out_q, out_k = qk_norm_rotary_(position_ids, q, k, cos_sin, q_weight, k_weight, EPS)
    assert out_q is q and out_k is k  # in place, returned as the reference returns its result
    tolerance = _tolerance(dtype, 6.0 if not normed else 8.0)
    torch.testing.assert_close(q, expected_q, **tolerance)
    torch.testing.assert_close(k, expected_k, **tolerance)
    # Only q and k changed: v and (gated) the gates are as they were.
    changed = qkv != before
    q_width = q.shape[1] * head_dim * (2 if gated else 1)
    assert not changed[:, q_width + k.shape[1] * head_dim :].any()
    if gated:
        assert not changed[:, :q_width].view(len(POSITIONS), 4, 2 * head_dim)[..., head_dim:].any()


def test_qk_norm_rotary_store_over_more_heads_than_one_program_holds() -> None:
    """12 q heads and 3 k heads of 128, partially rotated: a program's rows of (token, head) straddle tokens and
    the last q and k programs are part-full (masked); q, and the cache at the slots, as the references leave
    them."""
    head_dim, rotary_dim, num_kv_heads = 128, 64, 3
    _, q, k, v = _qkv_heads(len(POSITIONS), 12, num_kv_heads, head_dim, torch.float32, gated=False)
    q_weight, k_weight = _norm_weights(head_dim, torch.float32)
    position_ids = torch.tensor(POSITIONS, dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([9, 2, -1, 14, 0], dtype=torch.int64, device=DEVICE)
    cos_sin = _cos_sin(rotary_dim)
    k_cache = torch.zeros(16, num_kv_heads, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    expected_q, rotated_k = qk_norm_rotary_reference(position_ids, q, k, cos_sin, q_weight, k_weight, EPS)
    store_kv_reference(rotated_k, v, expected_k_cache, expected_v_cache, slots, 1.0, 1.0)
    qk_norm_rotary_store(position_ids, q, k, v, cos_sin, q_weight, k_weight, EPS, k_cache, v_cache, slots)
    tolerance = _tolerance(torch.float32, 8.0)
    torch.testing.assert_close(q, expected_q, **tolerance)
    torch.testing.assert_close(k_cache, expected_k_cache, **tolerance)
    assert torch.equal(v_cache, expected_v_cache)


def test_qk_norm_rotary_rejects_a_different_eps_and_swapped_norms() -> None:
    _, q, k, _ = _qkv_heads(len(POSITIONS), 4, 2, 64, torch.float32, gated=False)
    q, k = 0.01 * q, 0.01 * k  # small activations make eps matter
    q_weight, k_weight = _norm_weights(64, torch.float32)
    position_ids = torch.tensor(POSITIONS, dtype=torch.int64, device=DEVICE)
    cos_sin = _cos_sin(64)
    wrong_eps = qk_norm_rotary_reference(position_ids, q, k, cos_sin, q_weight, k_weight, 1e-4)
    swapped = qk_norm_rotary_reference(position_ids, q, k, cos_sin, k_weight, q_weight, 1e-5)
    qk_norm_rotary_(position_ids, q, k, cos_sin, q_weight, k_weight, 1e-5)
    tolerance = _tolerance(torch.float32, 8.0)
    for wrong_q, wrong_k in (wrong_eps, swapped):
        _assert_mismatch(q, wrong_q, tolerance)
        _assert_mismatch(k, wrong_k, tolerance)


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float16, torch.float8_e4m3fn),
    ],
)
def test_qk_norm_rotary_store_writes_what_rotary_then_store_kv_write(
    dtype: torch.dtype, cache_dtype: torch.dtype
) -> None:
    """The fused kernel leaves q as qk_norm_rotary does and the cache as store_kv does (padding rows skipped)."""
    head_dim, num_kv_heads = 32, 2
    qkv, q, k, v = _qkv_heads(len(POSITIONS), 4, num_kv_heads, head_dim, dtype, gated=False)
    k_before = k.clone()
    q_weight, k_weight = _norm_weights(head_dim, dtype)
    position_ids = torch.tensor(POSITIONS, dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([9, 2, -1, 14, 0], dtype=torch.int64, device=DEVICE)  # one padding row
    cos_sin = _cos_sin(head_dim)
    scales = (0.5, 0.25) if cache_dtype == torch.float8_e4m3fn else (1.0, 1.0)
    k_cache = torch.zeros(16, num_kv_heads, head_dim, device=DEVICE).to(cache_dtype)
    v_cache = torch.zeros_like(k_cache)
    expected_k_cache, expected_v_cache = k_cache.clone(), v_cache.clone()
    expected_q, rotated_k = qk_norm_rotary_reference(position_ids, q, k, cos_sin, q_weight, k_weight, EPS)
    store_kv_reference(rotated_k, v, expected_k_cache, expected_v_cache, slots, *scales)
    out_q = qk_norm_rotary_store(
        position_ids, q, k, v, cos_sin, q_weight, k_weight, EPS, k_cache, v_cache, slots, *scales
    )
    assert out_q is q
    tolerance = _tolerance(dtype, 8.0)
    torch.testing.assert_close(q, expected_q, **tolerance)
    assert torch.equal(k, k_before)  # k is only stored, not written back
    if cache_dtype == torch.float8_e4m3fn:
        # Against the store kernel itself: the interpreter's float -> fp8 conversion drops a rounding carry
        # (1.995 becomes 1.0), so torch's conversion is no reference there; on a GPU both convert alike.
        expected_k_cache.zero_(), expected_v_cache.zero_()
        store_kv(rotated_k, v, expected_k_cache, expected_v_cache, slots, *scales)
        # k differs from the reference by a few ulps before it is converted: at most one fp8 step after.
        torch.testing.assert_close(k_cache.float(), expected_k_cache.float(), rtol=0.125, atol=2e-3)
    else:
        torch.testing.assert_close(k_cache, expected_k_cache, **tolerance)
    assert torch.equal(v_cache.float(), expected_v_cache.float())
    assert not k_cache.float()[[1, 3]].any()  # slots no row names (the padding row's included) stay empty


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "in_features", "intermediate_size"), [(1, 64, 64), (5, 96, 200), (17, 40, 24)]
)
def test_gate_up_silu_matches_reference(
    num_tokens: int, in_features: int, intermediate_size: int, dtype: torch.dtype
) -> None:
    """Rows over two row blocks, K not a multiple of the K block, columns over several programs."""
    x = _strided_rows(num_tokens, in_features, dtype, seed=17)
    weight = _randn(2 * intermediate_size, in_features, seed=18, scale=in_features**-0.5).to(dtype)
    out = gate_up_silu(x, weight)
    assert out.shape == (num_tokens, intermediate_size) and out.dtype == dtype and out.is_contiguous()
    expected = gate_up_silu_reference(x, weight)
    # float32: the matmul sums in another order than torch's; half types: one rounding of a K-long sum.
    tolerance = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else _tolerance(dtype, 2.0)
    torch.testing.assert_close(out, expected, **tolerance)
    swapped = torch.cat(weight.chunk(2)[::-1])
    _assert_mismatch(out, gate_up_silu_reference(x, swapped), tolerance)
