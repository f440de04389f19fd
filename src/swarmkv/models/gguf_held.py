"""How swarmkv holds each tensor of a GGUF file: the one rule the loader and the planner both call, so the bytes
planned are the bytes held.

- A type of `gguf_quants.SPECS` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) is kept at its file's bits in the
  grouped layout: `held_bytes(kind, rows, cols)`.
- F32, F16 and BF16 (and F64) are held at the model's float (compute) dtype.
- Any other type (Q2_K, Q3_K, IQ*, TQ*, ...) is converted at load: to Q8_0 in the layout when its rows divide
  into Q8_0's groups of 32, to the float dtype otherwise.

Shapes are GGUF's: `shape[0]` is the number of columns (ne0, a row's length, the input features of a
projection), as `gguf.GGUFReader`'s `ReaderTensor.shape` gives it. A tensor of more than two dimensions is held
as rows = the product of the others.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from gguf import GGMLQuantizationType

from swarmkv.models.gguf_quants import SPECS, Q, held_bytes

FLOAT_KINDS = frozenset({Q.F32, Q.F16, Q.BF16, Q.F64})
CONVERT_TO = Q.Q8_0  # what a type the layout cannot keep becomes, when its rows allow it
HeldKind = GGMLQuantizationType | Literal["float"]
_BLOCK = re.compile(r"^blk\.(\d+)\.")


def rows_cols(shape: Sequence[int]) -> tuple[int, int]:
    """A GGUF shape (ne0 first) -> the [rows, cols] matrix the layout holds."""
    dims = [int(d) for d in shape]
    return math.prod(dims[1:]), dims[0]


def held_kind(kind: GGMLQuantizationType, shape: Sequence[int]) -> HeldKind:
    """What a tensor of GGUF type `kind` and GGUF shape `shape` is held as: its own type, Q8_0 (converted), or
    "float" (the compute dtype)."""
    if kind in FLOAT_KINDS:
        return "float"
    if kind in SPECS:
        return kind
    _, cols = rows_cols(shape)
    return CONVERT_TO if cols % SPECS[CONVERT_TO].group_size == 0 else "float"


def is_converted(kind: GGMLQuantizationType) -> bool:
    """Whether the loader converts this tensor (its type is neither float nor kept by the layout)."""
    return kind not in FLOAT_KINDS and kind not in SPECS


def tensor_held_bytes(kind: GGMLQuantizationType, shape: Sequence[int], float_dtype: torch.dtype) -> int:
    """Bytes swarmkv holds for one GGUF tensor (see the module docstring), floats at `float_dtype`."""
    held = held_kind(kind, shape)
    rows, cols = rows_cols(shape)
    if held == "float":
        return rows * cols * float_dtype.itemsize
    return held_bytes(held, rows, cols)


def nextn_first_block(metadata: Mapping[str, Any], arch: str) -> int | None:
    """The first block of a multi-token-prediction (NextN / MTP) head that llama.cpp's conversion appends after
    the model's layers (`{arch}.nextn_predict_layers`), or None when the file has none. swarmkv does not run
    it, so the loader does not hold its tensors."""
    extra = metadata.get(f"{arch}.nextn_predict_layers")
    blocks = metadata.get(f"{arch}.block_count")
    if not extra or blocks is None:
        return None
    return int(blocks) - int(extra)


def is_held(name: str, first_skipped_block: int | None) -> bool:
    """Whether the loader holds a tensor: every one, but the NextN / MTP blocks'."""
    match = _BLOCK.match(name)
    return first_skipped_block is None or match is None or int(match.group(1)) < first_skipped_block
