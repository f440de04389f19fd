"""The Triton weight-only quantized matmuls (int8 per channel, int4 groups with a minimum) against their torch
references (interpreted on the CPU)."""

from __future__ import annotations

import os

import pytest
import torch

# The interpreter must be chosen before the kernels are decorated; on a GPU machine the tests run compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from swarmkv.kernels.quant_matmul import (  # noqa: E402
    int4_matmul,
    int4_matmul_reference,
    int8_matmul,
    int8_matmul_reference,
    pack_int4,
    unpack_int4,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# Largest error allowed, relative to the largest output. float32 differs from the reference only in the
# order of the sums; fp16 and bf16 also round each dequantised weight and the output once.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}
# Decode (M <= 16, one row tile) and prefill (M > 16, one or two row tiles); N and K both leave a partial
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


def _int8_weight(n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = _generator(seed)
    qweight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = 0.005 + 0.02 * torch.rand(n, generator=gen)
    return qweight.to(DEVICE), scales.to(DEVICE, dtype)


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int8_matmul_matches_reference(m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x = _activations(m, k, dtype, seed=m)
    qweight, scales = _int8_weight(n, k, dtype, seed=n + k)
    out = int8_matmul(x, qweight, scales)
    ref = int8_matmul_reference(x, qweight, scales)
    assert _relative_error(out, ref) <= TOLERANCE[dtype]


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
    qweight, scales = _int8_weight(48, 128, dtype, seed=1)
    out = int8_matmul(strided, qweight, scales)
    assert _relative_error(out, int8_matmul_reference(x, qweight, scales)) <= TOLERANCE[dtype]
    qweight4, scales4, mins4 = _int4_weight(48, 128, 32, dtype, seed=2)
    out4 = int4_matmul(strided, qweight4, scales4, mins4, 32)
    assert _relative_error(out4, int4_matmul_reference(x, qweight4, scales4, mins4, 32)) <= TOLERANCE[dtype]


def test_scales_in_another_dtype_than_x() -> None:
    x = _activations(3, 128, torch.float32, seed=3)
    qweight, scales = _int8_weight(64, 128, torch.float16, seed=4)
    out = int8_matmul(x, qweight, scales)
    assert _relative_error(out, int8_matmul_reference(x, qweight, scales)) <= TOLERANCE[torch.float32]
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

    qweight8, scales8 = _int8_weight(64, 128, dtype, seed=13)
    out8 = int8_matmul(x, qweight8, scales8)
    assert _relative_error(out8, int8_matmul_reference(x, qweight8, scales8)) <= TOLERANCE[dtype]
    shifted = int8_matmul_reference(x, qweight8, scales8.roll(1))  # each row scaled by its neighbour's scale
    assert _relative_error(out8, shifted) > 5 * TOLERANCE[dtype]


def test_empty_batch() -> None:
    x = torch.empty(0, 64, device=DEVICE)
    qweight, scales = _int8_weight(48, 64, torch.float32, seed=0)
    assert int8_matmul(x, qweight, scales).shape == (0, 48)
    qweight4, scales4, mins4 = _int4_weight(48, 64, 32, torch.float32, seed=0)
    assert int4_matmul(x, qweight4, scales4, mins4, 32).shape == (0, 48)
