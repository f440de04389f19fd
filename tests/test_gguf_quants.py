"""The grouped layout of GGUF's quantized types: our quantizer's blocks, parsed and dequantised by us, equal
`gguf`'s own dequantisation bit for bit, at the bytes docs/quantized-layouts.md documents."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize
from gguf.quants import quantize as gguf_quantize

from swarmkv.models.gguf_quantize import quantize
from swarmkv.models.gguf_quants import (
    SPECS,
    GroupConstants,
    GroupedQuant,
    bits_per_weight,
    file_bits_per_weight,
    held_bytes,
    pack_codes,
    parse_blocks,
)

Q = GGMLQuantizationType
KINDS = list(SPECS)
SHAPES = [(1, 256), (4, 512), (3, 1024)]
# (file bits, held bits) per weight: the table of docs/quantized-layouts.md.
BITS = {
    Q.Q4_0: (4.5, 4.5),
    Q.Q4_1: (5.0, 5.0),
    Q.Q5_0: (5.5, 5.5),
    Q.Q5_1: (6.0, 6.0),
    Q.Q8_0: (8.5, 8.5),
    Q.Q4_K: (4.5, 4.625),
    Q.Q5_K: (5.5, 5.625),
    Q.Q6_K: (6.5625, 6.5625),
}
# Our round-to-nearest quantizer's error on N(0, 1) weights, relative to their norm (it measures 0.005 to 0.09).
MAX_RELATIVE_ERROR = {
    Q.Q4_0: 0.11,
    Q.Q4_1: 0.1,
    Q.Q5_0: 0.06,
    Q.Q5_1: 0.05,
    Q.Q8_0: 0.008,
    Q.Q4_K: 0.1,
    Q.Q5_K: 0.05,
    Q.Q6_K: 0.03,
}


def gguf_dequantized(raw: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, int]) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, kind).copy()).reshape(shape)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_ours_equals_gguf_bit_for_bit(kind: GGMLQuantizationType, shape: tuple[int, int]) -> None:
    torch.manual_seed(sum(shape) + kind.value)
    weight = torch.randn(shape) * 0.05 + 0.01
    raw = quantize(weight, kind)
    block, size = GGML_QUANT_SIZES[kind]
    assert raw.dtype == np.uint8 and raw.shape == (shape[0], shape[1] // block * size)
    reference = gguf_dequantized(raw, kind, shape)
    held = parse_blocks(raw, kind, shape)
    assert held.shape == shape
    ours = held.dequantize()
    assert ours.dtype == torch.float32 and torch.equal(ours, reference)
    relative = ((reference - weight).norm() / weight.norm()).item()
    assert relative < MAX_RELATIVE_ERROR[kind]


def test_blocks_as_a_gguf_file_holds_them(tmp_path: Path) -> None:
    """Every type written by gguf's writer and parsed from `GGUFReader`'s tensor data, as the loader reads it."""
    path, shape = tmp_path / "quants.gguf", (8, 512)
    weights = {kind: torch.randn(shape) for kind in KINDS}
    writer = GGUFWriter(path, "llama")
    for kind, weight in weights.items():
        writer.add_tensor(f"{kind.name}.weight", quantize(weight, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = GGUFReader(path).tensors
    assert [t.tensor_type for t in tensors] == KINDS
    for tensor in tensors:
        file_shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        assert file_shape == shape
        held = parse_blocks(tensor.data, tensor.tensor_type, shape)
        assert torch.equal(held.dequantize(), gguf_dequantized(tensor.data, tensor.tensor_type, shape))
        assert held.nbytes() == held_bytes(tensor.tensor_type, *shape)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_bytes_held_per_weight_as_documented(kind: GGMLQuantizationType) -> None:
    file_bits, held_bits = BITS[kind]
    assert file_bits_per_weight(kind) == file_bits
    assert bits_per_weight(kind) == held_bits
    rows, cols = 3, 1024
    held = parse_blocks(quantize(torch.randn(rows, cols), kind), kind, (rows, cols))
    assert held.nbytes() == held_bytes(kind, rows, cols) == rows * cols * held_bits / 8


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_gguf_quantized_blocks_parse_exactly(kind: GGMLQuantizationType) -> None:
    """Blocks that are not ours (gguf's quantizer, where it has one; random bytes for the K-quants)."""
    rows, cols = 5, 512
    weight = np.random.default_rng(kind.value).standard_normal((rows, cols)).astype(np.float32)
    try:
        raw = gguf_quantize(weight, kind)
    except NotImplementedError:
        # Any bytes are valid K-quant blocks once their float16 d and dmin are finite.
        raw = np.random.default_rng(1).integers(
            0, 256, (rows, cols // 256, GGML_QUANT_SIZES[kind][1]), np.uint8
        )
        scale_at = [208] if kind == Q.Q6_K else [0, 2]
        for at in scale_at:
            raw[..., at : at + 2] = np.float16(0.01 * (at + 1)).reshape(1).view(np.uint8)
        raw = raw.reshape(rows, -1)
    assert torch.equal(
        parse_blocks(raw, kind, (rows, cols)).dequantize(), gguf_dequantized(raw, kind, (rows, cols))
    )


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
def test_zero_and_constant_rows(kind: GGMLQuantizationType) -> None:
    weight = torch.zeros(2, 256)
    weight[1] = 0.25
    raw = quantize(weight, kind)
    reference = gguf_dequantized(raw, kind, (2, 256))
    assert torch.equal(parse_blocks(raw, kind, (2, 256)).dequantize(), reference)
    assert torch.equal(reference[0], weight[0]) and torch.isfinite(reference).all()
    assert torch.allclose(reference[1], weight[1], atol=0.02)


def test_quantize_rejects_rows_that_are_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(torch.zeros(2, 96), Q.Q4_K)


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_codes_pack_and_unpack(bits: int) -> None:
    rng = np.random.default_rng(bits)
    q = rng.integers(-128, 128, (3, 64)).astype(np.int8) if bits == 8 else rng.integers(0, 1 << bits, (3, 64))
    q = q if bits == 8 else q.astype(np.uint8)
    low, high = pack_codes(q, bits)
    layout = GroupedQuant(bits, 32, 0, low, high, GroupConstants(torch.ones(3, 2, dtype=torch.float16)))
    assert layout.shape == (3, 64)
    assert torch.equal(layout.codes(), torch.from_numpy(q.astype(np.int16)))
    assert layout.nbytes() == 3 * 64 * bits // 8 + 3 * 2 * 2


@pytest.mark.parametrize("group_size", [16, 32, 64, 128])
@pytest.mark.parametrize("minimums", [False, True], ids=["scales", "mins"])
@pytest.mark.parametrize("two_level", [False, True], ids=["fp16", "super"])
def test_group_size_and_minimums_are_parameters(group_size: int, minimums: bool, two_level: bool) -> None:
    """The dequantisation reads group size, offset and minimums from the layout: W = S (q - offset) + M."""
    rows, cols, bits, offset = 2, 512, 5, 16
    rng = np.random.default_rng(group_size)
    q = rng.integers(0, 32, (rows, cols)).astype(np.uint8)
    groups = cols // group_size

    def constants() -> tuple[GroupConstants, np.ndarray]:
        if not two_level:
            values = rng.standard_normal((rows, groups)).astype(np.float16)
            return GroupConstants(torch.from_numpy(values)), values.astype(np.float32)
        sub = rng.integers(0, 64, (rows, groups)).astype(np.uint8)
        outer = rng.standard_normal((rows, cols // 256)).astype(np.float16)
        wide = np.repeat(outer.astype(np.float32), groups // (cols // 256), axis=1) * sub.astype(np.float32)
        return GroupConstants(torch.from_numpy(sub), torch.from_numpy(outer)), wide

    scales, s = constants()
    mins, m = constants() if minimums else (None, np.zeros((rows, groups), np.float32))
    low, high = pack_codes(q, bits)
    layout = GroupedQuant(bits, group_size, offset, low, high, scales, mins)
    expected = np.repeat(s, group_size, axis=1) * (q.astype(np.float32) - offset)
    if minimums:
        expected = expected + np.repeat(m, group_size, axis=1)
    assert torch.equal(layout.dequantize(), torch.from_numpy(expected))


@pytest.mark.parametrize("kind", [Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda k: k.name)
def test_k_quant_group_scales_are_exact_in_float32_only(kind: GGMLQuantizationType) -> None:
    """d * sc (float16 times a 6- or 8-bit integer) fits float32's mantissa, not float16's: the layout keeps the
    factors, not float16 group scales (docs/quantized-layouts.md measures how many would round)."""
    held = parse_blocks(quantize(torch.randn(64, 1024) * 0.02, kind), kind, (64, 1024))
    outer, values = held.scales.outer, held.scales.values
    assert outer is not None
    exact = outer.double().repeat_interleave(values.shape[1] // outer.shape[1], 1) * values.double()
    product = held.scales.per_group()
    assert torch.equal(product.double(), exact)
    assert not torch.equal(product.half().float(), product)


@pytest.mark.parametrize("kind", [k for k in KINDS if SPECS[k].super_group is None], ids=lambda k: k.name)
def test_rows_of_whole_32_blocks(kind: GGMLQuantizationType) -> None:
    """Q4_0 .. Q8_0 rows need only be a multiple of 32 (an embedding of width 96, say)."""
    weight = torch.randn(3, 96)
    raw = quantize(weight, kind)
    held = parse_blocks(raw, kind, (3, 96))
    assert torch.equal(held.dequantize(), gguf_dequantized(raw, kind, (3, 96)))
    assert held.nbytes() == held_bytes(kind, 3, 96) == 3 * 96 * BITS[kind][1] / 8
