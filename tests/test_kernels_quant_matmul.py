"""The Triton weight-only quantized matmuls (int4 groups with a minimum; the general grouped layout's GEMV, int8
groups with a minimum among its layouts) against their torch references (interpreted on the CPU)."""

from __future__ import annotations

import os

import pytest
import torch

# The interpreter must be chosen before the kernels are decorated; on a GPU machine the tests run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from swarmkv.kernels.quant_gemv import (  # noqa: E402
    GEMV_MAX_ROWS,
    plan_quant_gemv,
    quant_gemv,
    quant_gemv_reference,
)
from swarmkv.kernels.quant_matmul import (  # noqa: E402
    int4_matmul,
    int4_matmul_reference,
    pack_int4,
    unpack_int4,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Largest error allowed, relative to the largest output. float32 differs from the reference only in the
# order of the sums; fp16 and bf16 also round each dequantised weight and the output once.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
# Decode (M <= 32, the GEMV) and prefill (M > 32, the GEMM, one or two row tiles); N and K both leave a partial
# last tile and K spans several steps at 320, so every mask and the K loop run.
SHAPES = [(1, 48, 64), (3, 160, 320), (33, 64, 128), (80, 160, 320)]


@pytest.fixture(autouse=True)
def _interpreter_dots_bf16_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the interpreter, give tl.dot the values of bf16 operands rather than their bits.

    The interpreter stores bf16 as uint16 and its tl.dot multiplies those bit patterns (upstream
    triton-lang/triton#11584, declined as unsupported). Widening bf16 to float32 is exact, so the kernels'
    own code still runs unchanged; compiled on a GPU, nothing is patched.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widen(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        values = (handle.data.astype(np.uint32) << 16).view(np.float32)
        return interpreter.TensorHandle(values, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _activations(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(m, k, generator=_generator(seed)).to(DEVICE, dtype)


def _int4_weight(
    n: int, k: int, group: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = _generator(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = 0.005 + 0.02 * torch.rand(n, k // group, generator=gen)
    # An asymmetric group: its minimum sits near -8 steps, jittered so mins are not a multiple of scales.
    mins = -scales * (8 + torch.rand(n, k // group, generator=gen))
    return pack_int4(q).to(DEVICE), scales.to(DEVICE, dtype), mins.to(DEVICE, dtype)


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max())


def _strided_rows(x: torch.Tensor) -> torch.Tensor:
    """The same values as x, each row 16 elements apart from the next (a view with a row stride)."""
    wide = torch.full((x.shape[0], x.shape[1] + 16), float("nan"), dtype=x.dtype, device=x.device)
    wide[:, 3 : 3 + x.shape[1]] = x
    view = wide[:, 3 : 3 + x.shape[1]]
    assert not view.is_contiguous() and view.stride(1) == 1
    return view


def _swap_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    return (qweight << 4) | (qweight >> 4)


def test_pack_int4_layout_and_round_trip() -> None:
    # element 0 in the low nibble, element 1 in the high one
    q = torch.tensor([[1, 2, 15, 0], [0, 15, 7, 9]], dtype=torch.uint8)
    assert pack_int4(q).tolist() == [[0x21, 0x0F], [0xF0, 0x97]]
    q = torch.randint(0, 16, (5, 64), generator=_generator(0), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int4_matmul_matches_reference(m: int, n: int, k: int, group: int, dtype: torch.dtype) -> None:
    x = _activations(m, k, dtype, seed=m)
    qweight, scales, mins = _int4_weight(n, k, group, dtype, seed=n + k + group)
    out = int4_matmul(x, qweight, scales, mins, group)
    ref = int4_matmul_reference(x, qweight, scales, mins, group)
    assert _relative_error(out, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("m", [3, 33])
def test_row_strided_activations(m: int) -> None:
    """x may be a view whose rows are further apart than K; the padding (NaN) must never be read."""
    dtype = torch.float16
    x = _activations(m, 128, dtype, seed=7)
    strided = _strided_rows(x)
    qweight4, scales4, mins4 = _int4_weight(48, 128, 32, dtype, seed=2)
    out4 = int4_matmul(strided, qweight4, scales4, mins4, 32)
    assert _relative_error(out4, int4_matmul_reference(x, qweight4, scales4, mins4, 32)) <= TOLERANCE[dtype]


def test_scales_in_another_dtype_than_x() -> None:
    x = _activations(3, 128, torch.float32, seed=3)
    qweight4, scales4, mins4 = _int4_weight(64, 128, 64, torch.bfloat16, seed=5)
    out4 = int4_matmul(x, qweight4, scales4, mins4, 64)
    ref4 = int4_matmul_reference(x, qweight4, scales4, mins4, 64)
    assert _relative_error(out4, ref4) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("m", [1, 33])
def test_tolerance_rejects_a_wrong_layout(m: int) -> None:
    """At the loosest tolerance (bf16), a kernel reading a mutated layout would fail the comparisons above."""
    dtype, group = torch.bfloat16, 32
    x = _activations(m, 128, dtype, seed=11)
    qweight, scales, mins = _int4_weight(64, 128, group, dtype, seed=12)
    out = int4_matmul(x, qweight, scales, mins, group)
    assert _relative_error(out, int4_matmul_reference(x, qweight, scales, mins, group)) <= TOLERANCE[dtype]
    wrong = [
        int4_matmul_reference(x, _swap_nibbles(qweight), scales, mins, group),  # odd k in the low nibble
        # the group of k taken as k // G + 1 (wrapping), for scales, mins or both
        int4_matmul_reference(x, qweight, scales.roll(-1, dims=1), mins, group),
        int4_matmul_reference(x, qweight, scales, mins.roll(-1, dims=1), group),
        int4_matmul_reference(x, qweight, scales.roll(-1, dims=1), mins.roll(-1, dims=1), group),
        # the group of k taken as k // 2G: each scale and minimum stretched over two groups
        int4_matmul_reference(
            x, qweight, scales.repeat_interleave(2, 1)[:, :4], mins.repeat_interleave(2, 1)[:, :4], group
        ),
    ]
    for expected in wrong:
        assert _relative_error(out, expected) > 5 * TOLERANCE[dtype]


def test_empty_batch() -> None:
    x = torch.empty(0, 64, device=DEVICE)
    qweight4, scales4, mins4 = _int4_weight(48, 64, 32, torch.float32, seed=0)
    assert int4_matmul(x, qweight4, scales4, mins4, 32).shape == (0, 48)


# --- kernels/quant_gemv.py over the general layout (bits, group, offset, minimums) ------------------------
# Decode tiles: the vector-unit path (M = 1, 2) and the tl.dot path (3, 16: a 16-row tile; 17, 32: a 32-row
# tile, partly masked); prefill tiles: 40 (one 64-row tile), 70 (two). K = 320 and 576 leave a partial last K
# step, and every K spans at least two steps (a split each); N = 40 and 72 leave a partial row tile.
GROUPED_SHAPES = [
    (1, 40, 320),
    (2, 64, 576),
    (3, 40, 320),
    (16, 72, 576),
    (17, 40, 320),
    (32, 48, 512),
    (40, 136, 320),
    (70, 40, 576),
]


def _codes(n: int, k: int, bits: int, seed: int) -> torch.Tensor:
    gen = _generator(seed)
    if bits == 4:
        return pack_int4(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)).to(DEVICE)
    return torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8).to(DEVICE)


def _group_constants(
    n: int, k: int, group: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = _generator(seed)
    scales = 0.005 + 0.02 * torch.rand(n, k // group, generator=gen)
    mins = -scales * (8 + torch.rand(n, k // group, generator=gen))
    return scales.to(DEVICE, dtype), mins.to(DEVICE, dtype)


@pytest.mark.parametrize(("m", "n", "k"), GROUPED_SHAPES)
@pytest.mark.parametrize(
    ("bits", "group", "offset", "with_mins"),
    [
        (4, 32, 0, True),  # Q4_1 / int4 groups with a minimum
        (4, 32, 8, False),  # Q4_0: d * (q - 8)
        (4, 16, 0, True),  # groups of 16: 8-byte chunks
        (4, 64, 0, True),  # two chunks per group
        (8, 32, 0, False),  # Q8_0
        (8, 32, 0, True),  # the weight format int8: groups with a minimum
    ],
)
@pytest.mark.parametrize("splits", [1, 2])
def test_gemv_matches_reference(
    m: int, n: int, k: int, bits: int, group: int, offset: int, with_mins: bool, splits: int
) -> None:
    dtype = torch.float16
    x = _activations(m, k, dtype, seed=m + k)
    qweight = _codes(n, k, bits, seed=n + bits)
    scales, mins = _group_constants(n, k, group, dtype, seed=group + n)
    low = mins if with_mins else None
    options = dict(bits=bits, group=group, offset=offset)
    assert plan_quant_gemv(m, n, k, bits, group, num_sms=1, splits=splits).splits == splits
    out = quant_gemv(x, qweight, scales, low, num_sms=1, splits=splits, **options)
    ref = quant_gemv_reference(x, qweight, scales, low, **options)
    assert _relative_error(out, ref) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 8])
def test_gemv_other_dtypes(m: int, dtype: torch.dtype) -> None:
    x = _activations(m, 320, dtype, seed=5)
    qweight, scales, mins = _int4_weight(40, 320, 32, dtype, seed=6)
    out = int4_matmul(x, qweight, scales, mins, 32, splits=2)
    assert _relative_error(out, int4_matmul_reference(x, qweight, scales, mins, 32)) <= TOLERANCE[dtype]
    qweight8 = _codes(40, 320, 8, seed=7)
    scales8, mins8 = _group_constants(40, 320, 32, dtype, seed=7)
    options = dict(bits=8, group=32)
    out8 = quant_gemv(x, qweight8, scales8, mins8, num_sms=1, splits=2, **options)
    assert (
        _relative_error(out8, quant_gemv_reference(x, qweight8, scales8, mins8, **options))
        <= TOLERANCE[dtype]
    )


def test_split_k_is_sized_from_the_sm_count_and_reproducible() -> None:
    """Few output tiles on many SMs split K (never into empty splits); the split sums are the same every run."""
    few_tiles = plan_quant_gemv(1, 64, 4096, bits=4, group=32, num_sms=132)
    assert few_tiles.splits > 1
    assert (few_tiles.splits - 1) * few_tiles.steps_per_split < 4096 // 256  # the last split has a step
    assert plan_quant_gemv(1, 1024, 4096, bits=4, group=32, num_sms=1).splits == 1  # 32 tiles fill one SM
    assert plan_quant_gemv(GEMV_MAX_ROWS, 65536, 4096, bits=4, group=32, num_sms=132).splits == 1
    x = _activations(2, 1024, torch.float32, seed=8)
    qweight, scales, mins = _int4_weight(40, 1024, 32, torch.float32, seed=9)
    runs = [int4_matmul(x, qweight, scales, mins, 32, splits=3) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    ref = int4_matmul_reference(x, qweight, scales, mins, 32)
    assert _relative_error(runs[0], ref) <= TOLERANCE[torch.float32]


def test_a_group_that_is_not_a_power_of_two() -> None:
    """Groups of 48 codes: each lane loads 16 of them (8 bytes), so no chunk spans two groups."""
    x = _activations(2, 480, torch.float16, seed=12)
    qweight, scales, mins = _int4_weight(40, 480, 48, torch.float16, seed=13)
    out = int4_matmul(x, qweight, scales, mins, 48)
    assert (
        _relative_error(out, int4_matmul_reference(x, qweight, scales, mins, 48)) <= TOLERANCE[torch.float16]
    )
