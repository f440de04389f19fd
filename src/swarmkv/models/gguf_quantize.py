"""A quantizer of ours for every GGUF type `gguf_quants.py` holds (the `gguf` package quantizes only a few):
tests write GGUF files in each type with it. Round to nearest with min/max scales; valid blocks, not ggml's
error-minimising search."""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from swarmkv.models.gguf_quants import SPECS, Q


def _inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, 0, 1 / d).astype(np.float32)


def _as_f16_bytes(x: np.ndarray) -> np.ndarray:
    """float [B] -> its float16 bytes [B, 2]."""
    return x.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _signed_max(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude along the last axis, with its sign."""
    return np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], axis=-1)[..., 0]


def _pack_nibbles_32(q: np.ndarray) -> np.ndarray:
    """Codes [B, 32 c] -> bytes [B, 16 c], the inverse of `_nibbles_32`."""
    q = q.reshape(q.shape[0], -1, 2, 16)
    return (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(q.shape[0], -1)


def _legacy(kind: GGMLQuantizationType, x: np.ndarray) -> np.ndarray:
    """Blocks [B, 32] of Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, rounding to nearest."""
    spec = SPECS[kind]
    levels = (1 << spec.bits) - 1
    if spec.has_mins:
        low, high = x.min(-1), x.max(-1)
        d = ((high - low) / levels).astype(np.float16)
        m = low.astype(np.float16)
        q = np.rint((x - m.astype(np.float32)[:, None]) * _inverse(d.astype(np.float32))[:, None])
        head = [_as_f16_bytes(d), _as_f16_bytes(m)]
    else:
        # As ggml does, the block's largest magnitude maps to code 0 (-offset), so it is never clipped.
        d = (_signed_max(x) / -spec.offset if spec.offset else np.abs(x).max(-1) / 127).astype(np.float16)
        q = np.rint(x * _inverse(d.astype(np.float32))[:, None]) + spec.offset
        head = [_as_f16_bytes(d)]
    if kind == Q.Q8_0:
        return np.concatenate([*head, np.clip(q, -127, 127).astype(np.int8).view(np.uint8)], axis=-1)
    q = np.clip(q, 0, levels).astype(np.uint8)
    if spec.bits == 5:
        head.append(np.packbits(q >> 4, axis=-1, bitorder="little"))
    return np.concatenate([*head, _pack_nibbles_32(q & 0xF)], axis=-1)


def _two_level(values: np.ndarray, top: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-group floats [B, G] -> a float16 super-scale [B] and integer sub-scales [B, G] in -top..top."""
    outer = (np.abs(values).max(-1) / top).astype(np.float16)
    sub = np.clip(np.rint(values * _inverse(outer.astype(np.float32))[:, None]), -top, top)
    return outer, sub.astype(np.int16)


def _k_quant(kind: GGMLQuantizationType, x: np.ndarray) -> np.ndarray:
    """Super-blocks [B, 256] of Q4_K/Q5_K/Q6_K: min/max per sub-block, scales quantized against the super one."""
    spec = SPECS[kind]
    sub = x.reshape(x.shape[0], -1, spec.group_size)
    levels = (1 << spec.bits) - 1
    if spec.has_mins:
        neg_low = -np.minimum(sub.min(-1), 0)  # stored as a non-negative m: w = d sc q - dmin m
        d, sc = _two_level((sub.max(-1) + neg_low) / levels, 63)
        dmin, mn = _two_level(neg_low, 63)
        offset = (dmin.astype(np.float32)[:, None] * mn)[..., None]
    else:
        d, sc = _two_level(_signed_max(sub) / -spec.offset, 127)
        offset = spec.offset * (d.astype(np.float32)[:, None] * sc)[..., None]
    scale = d.astype(np.float32)[:, None, None] * sc[..., None]
    q = np.clip(np.rint((sub + offset) * _inverse(scale)), 0, levels).astype(np.uint8).reshape(x.shape[0], -1)
    if kind == Q.Q6_K:
        q = q.reshape(-1, 2, 4, 32)  # 128 h + 32 t + j
        ql = (q[:, :, 0:2] & 0xF) | ((q[:, :, 2:4] & 0xF) << 4)  # byte 64 h + 32 s + j: t = s and t = s + 2
        qh = np.bitwise_or.reduce((q >> 4) << (np.arange(4, dtype=np.uint8) * 2)[:, None], axis=2)
        scales = sc.astype(np.int8).view(np.uint8)
        return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), scales, _as_f16_bytes(d)], axis=-1)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    packed = np.concatenate(
        [
            (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),
            (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4),
        ],
        axis=-1,
    )
    chunks = q.reshape(-1, 4, 2, 32)  # 64 c + 32 s + j, byte 32 c + j
    qs = (chunks[:, :, 0] & 0xF) | ((chunks[:, :, 1] & 0xF) << 4)
    head = [_as_f16_bytes(d), _as_f16_bytes(dmin), packed]
    if kind == Q.Q5_K:
        hi = (q.reshape(-1, 8, 32) >> 4) << np.arange(8, dtype=np.uint8)[:, None]
        head.append(np.bitwise_or.reduce(hi, axis=1))
    return np.concatenate([*head, qs.reshape(-1, 128)], axis=-1)


def quantize(weight: torch.Tensor | np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """A float weight [..., K] -> GGUF blocks of `kind` [..., K / block * type_size] (uint8), as a GGUF file
    stores them. Round to nearest with plain min/max scales: valid blocks for tests, not llama.cpp's quality."""
    x = (
        weight.detach().float().numpy()
        if isinstance(weight, torch.Tensor)
        else np.asarray(weight, np.float32)
    )
    block, size = GGML_QUANT_SIZES[kind]
    if x.shape[-1] % block:
        raise ValueError(f"{kind.name} needs rows that are a multiple of {block}, got {x.shape[-1]}")
    blocks = x.reshape(-1, block).astype(np.float32)
    raw = _k_quant(kind, blocks) if SPECS[kind].super_group else _legacy(kind, blocks)
    assert raw.shape[-1] == size
    return raw.reshape(*x.shape[:-1], x.shape[-1] // block * size)
