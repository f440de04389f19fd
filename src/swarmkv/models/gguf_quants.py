"""GGUF quantized blocks held at their file's bits: one grouped layout for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K and Q6_K, its exact float32 dequantisation, and the weight format "int8" in the same layout (`int8_groups`).

The layout (docs/quantized-layouts.md has the decision and its numbers), for a weight [N, K]:
- codes: `low` uint8 [N, K / 2], element k in byte k // 2 (low nibble when k is even) for 4-, 5- and 6-bit
  types; `high` holds the bits above the nibble, uint8 [N, K / 8] (5 bits: bit k % 8 of byte k // 8) or
  [N, K / 4] (6 bits: bits 2 (k % 4) and up of byte k // 4). 8-bit codes are `low` int8 [N, K].
- W[n, k] = S[n, g] * (q[n, k] - offset) (+ M[n, g]) for g = k // group_size, where S and M are `GroupConstants`:
  float16 per group, or (K-quants) a small integer per group times a float16 per super-group of 256. A K-quant's
  minimum is stored as -dmin so that every type adds M. The order of operations is `gguf.quants.dequantize`'s,
  so the result is bit-identical to it in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from swarmkv.errors import ModelLoadError

Q = GGMLQuantizationType
SUPER_GROUP = 256  # QK_K: a K-quant super-block


@dataclass(frozen=True)
class QuantSpec:
    """How one GGUF type maps onto the layout: code bits, weights per scale, code offset, and what it keeps."""

    bits: int
    group_size: int
    offset: int
    has_mins: bool
    super_group: int | None  # weights per float16 super-scale (K-quants), None for one float16 per group
    sub_scale_dtype: torch.dtype = torch.uint8  # the K-quants' per-group integer scales


SPECS: dict[GGMLQuantizationType, QuantSpec] = {
    Q.Q4_0: QuantSpec(4, 32, 8, False, None),
    Q.Q4_1: QuantSpec(4, 32, 0, True, None),
    Q.Q5_0: QuantSpec(5, 32, 16, False, None),
    Q.Q5_1: QuantSpec(5, 32, 0, True, None),
    Q.Q8_0: QuantSpec(8, 32, 0, False, None),
    Q.Q4_K: QuantSpec(4, 32, 0, True, SUPER_GROUP),
    Q.Q5_K: QuantSpec(5, 32, 0, True, SUPER_GROUP),
    Q.Q6_K: QuantSpec(6, 16, 32, False, SUPER_GROUP, torch.int8),
}


@dataclass(frozen=True)
class GroupConstants:
    """One float per group of a row: `values` float16 [N, G], or small integers [N, G] times `outer` float16
    [N, G / groups_per_outer] (a K-quant's d or -dmin per super-block)."""

    values: torch.Tensor
    outer: torch.Tensor | None = None

    def per_group(self) -> torch.Tensor:
        """The float32 constant of every group [N, G]; d * sc rounds exactly as gguf's float32 product does."""
        if self.outer is None:
            return self.values.float()
        per = self.values.shape[1] // self.outer.shape[1]
        return self.outer.float().repeat_interleave(per, dim=1) * self.values.float()

    def nbytes(self) -> int:
        """Bytes held."""
        outer = 0 if self.outer is None else self.outer.nbytes
        return self.values.nbytes + outer

    def to(self, device: torch.device) -> GroupConstants:
        """The same constants on `device`."""
        return GroupConstants(self.values.to(device), None if self.outer is None else self.outer.to(device))

    def take_rows(self, index: torch.Tensor) -> GroupConstants:
        """The constants of rows `index`."""
        return GroupConstants(self.values[index], None if self.outer is None else self.outer[index])

    @staticmethod
    def cat_rows(parts: list[GroupConstants]) -> GroupConstants:
        """Row blocks stacked; all of one kind."""
        outers = [p.outer for p in parts]
        outer = None if outers[0] is None else torch.cat([o for o in outers if o is not None])
        return GroupConstants(torch.cat([p.values for p in parts]), outer)


@dataclass(frozen=True)
class GroupedQuant:
    """A [N, K] weight in the layout of the module docstring; group size, offset and minimums are its own."""

    bits: int
    group_size: int
    offset: int
    low: torch.Tensor
    high: torch.Tensor | None
    scales: GroupConstants
    mins: GroupConstants | None = None

    def __post_init__(self) -> None:
        rows, cols = self.shape
        assert self.bits in (4, 5, 6, 8) and cols % self.group_size == 0
        assert (self.high is None) == (self.bits in (4, 8))
        assert self.high is None or self.high.shape == (rows, cols * (self.bits - 4) // 8)
        for constants in (self.scales, self.mins):
            assert constants is None or constants.values.shape == (rows, cols // self.group_size)

    @property
    def shape(self) -> tuple[int, int]:
        """The dequantised weight's [N, K]."""
        rows, cols = self.low.shape
        return rows, cols * (1 if self.bits == 8 else 2)

    def codes(self) -> torch.Tensor:
        """The integer codes q [N, K] as int16 (before the offset)."""
        if self.bits == 8:
            return self.low.to(torch.int16)
        rows, cols = self.shape
        q = torch.stack([self.low & 0xF, self.low >> 4], dim=-1).reshape(rows, cols).to(torch.int16)
        if self.high is not None:
            width = self.bits - 4
            shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=self.low.device)
            hi = (self.high[..., None] >> shifts) & ((1 << width) - 1)
            q = q | (hi.reshape(rows, cols).to(torch.int16) << 4)
        return q

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K], bit-identical to `gguf.quants.dequantize` of the blocks it came from."""
        q = (self.codes() - self.offset).float()
        w = self.scales.per_group().repeat_interleave(self.group_size, dim=1) * q
        if self.mins is not None:
            w = w + self.mins.per_group().repeat_interleave(self.group_size, dim=1)
        return w

    def nbytes(self) -> int:
        """Bytes held: codes, scales and minimums."""
        high = 0 if self.high is None else self.high.nbytes
        mins = 0 if self.mins is None else self.mins.nbytes()
        return self.low.nbytes + high + self.scales.nbytes() + mins

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor held (for counting bytes and registering buffers)."""
        held = [self.low, self.high, self.scales.values, self.scales.outer]
        if self.mins is not None:
            held += [self.mins.values, self.mins.outer]
        return [t for t in held if t is not None]

    def kind(self) -> tuple[object, ...]:
        """What a kernel call depends on besides the data: equal kinds can be stacked into one weight."""
        two_level = self.scales.outer is not None
        return (
            self.bits,
            self.group_size,
            self.offset,
            self.mins is not None,
            two_level,
            self.scales.values.dtype,
        )

    def to(self, device: torch.device) -> GroupedQuant:
        """The same weight on `device` (a GPU's Triton kernel reads it there: kernels/grouped_matmul.py)."""
        if self.low.device == device:
            return self
        return GroupedQuant(
            self.bits,
            self.group_size,
            self.offset,
            self.low.to(device),
            None if self.high is None else self.high.to(device),
            self.scales.to(device),
            None if self.mins is None else self.mins.to(device),
        )

    def take_rows(self, index: torch.Tensor) -> GroupedQuant:
        """Rows `index` of the weight (a row permutation or slice keeps every row's own constants)."""
        mins = None if self.mins is None else self.mins.take_rows(index)
        high = None if self.high is None else self.high[index]
        return GroupedQuant(
            self.bits, self.group_size, self.offset, self.low[index], high, self.scales.take_rows(index), mins
        )

    @staticmethod
    def cat_rows(parts: list[GroupedQuant]) -> GroupedQuant:
        """Row blocks of one kind stacked into one weight (a fused projection's shards)."""
        first = parts[0]
        assert all(p.kind() == first.kind() and p.shape[1] == first.shape[1] for p in parts)
        highs = [p.high for p in parts]
        high = None if highs[0] is None else torch.cat([h for h in highs if h is not None])
        mins = [p.mins for p in parts]
        return GroupedQuant(
            first.bits,
            first.group_size,
            first.offset,
            torch.cat([p.low for p in parts]),
            high,
            GroupConstants.cat_rows([p.scales for p in parts]),
            None if mins[0] is None else GroupConstants.cat_rows([m for m in mins if m is not None]),
        )


INT8_GROUP_SIZE = 32  # the weight format "int8": GGUF's legacy block, so a Q4_0/Q4_1/Q5 group maps onto one


def int8_groups(weight: torch.Tensor) -> GroupedQuant:
    """A float weight [N, K] in the weight format "int8": 8-bit codes in groups of 32, each group with a float16
    minimum M (about min + 128 S) and scale S (about (max - min) / 255), W = S q + M with q in -128..127.

    The minimum spends the 256 codes on the group's own range, which symmetric int8 (Q8_0) halves for a group
    that is all of one sign. The groups are a GGUF file's legacy blocks, so a Q4_0/Q4_1/Q5_0/Q5_1 weight keeps
    its grid: its 16 or 32 levels fall within a float16 rounding of every 17th or 8th code. Per output channel
    instead, one outlier sets the step of a whole row (docs/quantized-layouts.md has the agreement figures).
    ModelLoadError for values float16 constants cannot hold (beyond +-65504, or not finite)."""
    rows, cols = weight.shape
    assert cols % INT8_GROUP_SIZE == 0, f"int8 groups need whole groups of {INT8_GROUP_SIZE}, got {cols}"
    groups = weight.float().reshape(rows, cols // INT8_GROUP_SIZE, INT8_GROUP_SIZE)
    low, high = groups.amin(-1), groups.amax(-1)
    mins = (low + 128 * ((high - low) / 255)).to(torch.float16)
    # S is sized from the rounded M, and rounded up, so that codes -128 and 127 reach both ends of the group:
    # no code is clamped, and every weight is within half a step. Codes are then chosen against the float16
    # constants the kernels read, so their rounding is not carried into every weight of the group alike.
    base = mins.float()
    need = torch.maximum((high - base) / 127, (base - low) / 128).clamp(min=0)
    scales = need.to(torch.float16)
    scales = torch.where(
        scales.float() < need, torch.nextafter(scales, torch.full_like(scales, torch.inf)), scales
    )
    finite = weight.device.type == "meta" or bool(torch.isfinite(scales).all() and torch.isfinite(mins).all())
    if not finite:  # (a meta weight, the planner's, has shapes only)
        raise ModelLoadError(
            "int8 weights hold a float16 scale and minimum per group of 32: this weight has values beyond"
            " float16's range (+-65504) or not finite; use --weights float"
        )
    step = scales.float()[..., None]
    q = torch.where(step > 0, torch.round((groups - base[..., None]) / step), 0).clamp(-128, 127)
    codes = q.to(torch.int8).reshape(rows, cols)
    return GroupedQuant(8, INT8_GROUP_SIZE, 0, codes, None, GroupConstants(scales), GroupConstants(mins))


def held_bytes(kind: GGMLQuantizationType, rows: int, cols: int) -> int:
    """Bytes a [rows, cols] weight of `kind` holds in the layout (what the planner counts)."""
    spec = SPECS[kind]
    code_bits = spec.bits * cols
    groups = cols // spec.group_size
    per_row = code_bits // 8
    constants = 2 if spec.has_mins else 1
    if spec.super_group is None:
        per_row += constants * groups * 2
    else:
        per_row += constants * (groups * spec.sub_scale_dtype.itemsize + cols // spec.super_group * 2)
    return rows * per_row


def bits_per_weight(kind: GGMLQuantizationType) -> float:
    """Bits the layout holds per weight (a row of 256: every type's whole blocks)."""
    return held_bytes(kind, 1, SUPER_GROUP) * 8 / SUPER_GROUP


def file_bits_per_weight(kind: GGMLQuantizationType) -> float:
    """Bits per weight in the GGUF file."""
    block, size = GGML_QUANT_SIZES[kind]
    return size * 8 / block


# --- parsing GGUF blocks -------------------------------------------------------------------------------


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte `start` of every block [R, B]."""
    return np.ascontiguousarray(blocks[..., start : start + 2]).view(np.float16)[..., 0]


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit scales and minimums of Q4_K/Q5_K's 12 packed bytes [..., 12] -> two uint8 [..., 8]."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., 16 c] holding element j of each 32 in the low nibble of byte j and j + 16 in the high one."""
    qs = qs.reshape(*qs.shape[:-1], -1, 16)
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(*qs.shape[:-2], -1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's little-endian 32-bit qh [..., 4] -> element j's fifth bit, bit j of qh [..., 32]."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _codes_from_blocks(kind: GGMLQuantizationType, blocks: np.ndarray) -> np.ndarray:
    """Every block's codes [R, B, block] as uint8 (int8 for Q8_0), in element order."""
    if kind == Q.Q8_0:
        return blocks[..., 2:].view(np.int8)
    if kind in (Q.Q4_0, Q.Q4_1):
        return _nibbles_32(blocks[..., 2 if kind == Q.Q4_0 else 4 :])
    if kind in (Q.Q5_0, Q.Q5_1):
        start = 2 if kind == Q.Q5_0 else 4
        low = _nibbles_32(blocks[..., start + 4 :])
        return low | (_high_bits(blocks[..., start : start + 4]) << 4)
    if kind in (Q.Q4_K, Q.Q5_K):
        qs = blocks[..., -128:].reshape(*blocks.shape[:-1], 4, 1, 32)
        low = ((qs >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0xF).reshape(*blocks.shape[:-1], 256)
        if kind == Q.Q4_K:
            return low
        qh = blocks[..., 16:48].reshape(*blocks.shape[:-1], 1, 32)
        hi = ((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1).reshape(*blocks.shape[:-1], 256)
        return low | (hi << 4)
    assert kind == Q.Q6_K
    lead = blocks.shape[:-1]
    ql = blocks[..., :128].reshape(*lead, 2, 1, 64)
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)
    low = ((ql >> np.array([0, 4], dtype=np.uint8)[:, None]) & 0xF).reshape(*lead, 256)
    hi = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3).reshape(*lead, 256)
    return low | (hi << 4)


def pack_codes(q: np.ndarray, bits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Codes [N, K] -> the layout's `low` and `high` planes."""
    if bits == 8:
        return torch.from_numpy(np.ascontiguousarray(q)), None
    low = (q[:, 0::2] & 0xF) | ((q[:, 1::2] & 0xF) << 4)
    high = None
    if bits > 4:
        width = bits - 4
        per_byte = 8 // width
        parts = (q >> 4).reshape(q.shape[0], -1, per_byte) << (np.arange(per_byte, dtype=np.uint8) * width)
        high = torch.from_numpy(np.bitwise_or.reduce(parts, axis=-1).astype(np.uint8))
    return torch.from_numpy(np.ascontiguousarray(low)), high


def parse_blocks(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, int]) -> GroupedQuant:
    """GGUF block bytes of a [rows, cols] weight (as `gguf.GGUFReader` gives them) -> the layout."""
    spec = SPECS[kind]
    rows, cols = shape
    block, size = GGML_QUANT_SIZES[kind]
    blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows, cols // block, size)
    low, high = pack_codes(_codes_from_blocks(kind, blocks).reshape(rows, cols), spec.bits)
    mins: GroupConstants | None = None
    if spec.super_group is None:
        scales = GroupConstants(torch.from_numpy(_f16(blocks, 0).copy()))
        if spec.has_mins:
            mins = GroupConstants(torch.from_numpy(_f16(blocks, 2).copy()))
    elif kind == Q.Q6_K:
        sub = blocks[..., 192:208].view(np.int8).reshape(rows, -1)
        scales = GroupConstants(torch.from_numpy(sub.copy()), torch.from_numpy(_f16(blocks, 208).copy()))
    else:
        sc, mn = _scale_min_k4(blocks[..., 4:16])
        scales = GroupConstants(
            torch.from_numpy(sc.reshape(rows, -1)), torch.from_numpy(_f16(blocks, 0).copy())
        )
        neg_dmin = torch.from_numpy(-_f16(blocks, 2))  # w = d sc q - dmin m = d sc q + (-dmin) m, exactly
        mins = GroupConstants(torch.from_numpy(mn.reshape(rows, -1)), neg_dmin)
    return GroupedQuant(spec.bits, spec.group_size, spec.offset, low, high, scales, mins)
