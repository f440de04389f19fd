"""Read GGUF tensors as Hugging Face-named tensors, undoing llama.cpp's Q/K row permutation (and, for qwen35,
the converter's arithmetic on small tensors: `gguf_qwen35`). Three ways to keep them: every quantized tensor
at its file's bits as a `GroupedQuant` ("gguf", the CPU default), Q4_0 and Q4_1 projection weights as int4
groups of 32 ("int4"), or everything dequantised to float. A quantized type the grouped layout does not hold
is converted to Q8_0 in it, its error measured and reported."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

import swarmkv.resolve as resolve
from swarmkv.config import ModelConfig
from swarmkv.errors import ModelLoadError
from swarmkv.kernels.reference import pack_int4
from swarmkv.models.gguf_file import GGUFFile
from swarmkv.models.gguf_held import CONVERT_TO, held_kind, rows_cols
from swarmkv.models.gguf_quants import SPECS, GroupedQuant, parse_blocks
from swarmkv.models.gguf_qwen35 import needs_float, qwen35_hf_name, qwen35_tensor
from swarmkv.models.quantized import INT4_GROUP_SIZE, QuantizedWeight, WeightFormat
from swarmkv.resolve import Checkpoint

log = logging.getLogger(__name__)
Keep = Literal["float", "int4", "gguf"]

_Q4 = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}  # bytes per block of 32
_FLOAT = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
# qwen35's linear attention adds attn_qkv, attn_gate and ssm_out (its ssm_alpha and ssm_beta stay float).
_PROJECTION = re.compile(
    r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down|attn_qkv|attn_gate|ssm_out)\.weight$"
)


def checkpoint_kind(file: GGUFFile) -> Checkpoint:
    """What `weights=auto` looks at: whether the file holds any quantized tensor (every quantized format runs on
    the grouped layout's kernels or on Triton, so a device without them gets no better choice than its own bits:
    the loader asks for triton there)."""
    return "gguf-float" if {t.tensor_type for t in file.reader.tensors} <= _FLOAT else "gguf-quantized"


def auto_weight_format(file: GGUFFile) -> WeightFormat:
    """The format `weights=auto` keeps a file's weights in (`swarmkv.resolve.weight_format`)."""
    return resolve.weight_format("auto", checkpoint_kind(file))


@dataclass
class TypeReport:
    """One GGUF type's tensors in a loaded model: how many, their bytes in the file and as held."""

    tensors: int = 0
    file_bytes: int = 0
    held_bytes: int = 0
    held_as: str = ""  # the type held: the file's own, CONVERT_TO's name, or the compute dtype
    max_abs_error: float = 0.0  # converted types only: against the file's own dequantisation
    max_relative_error: float = 0.0  # max abs error / max abs weight, over the type's tensors

    def to_json(self) -> dict[str, Any]:
        """As `stats()` shows it."""
        return dict(self.__dict__)


@dataclass
class WeightReport:
    """Per GGUF type, what the loader held (filled while the tensors stream in)."""

    types: dict[str, TypeReport] = field(default_factory=dict)

    def add(
        self, kind: GGMLQuantizationType, file_bytes: int, held: torch.Tensor | GroupedQuant
    ) -> TypeReport:
        """Count one tensor of `kind` as held."""
        entry = self.types.setdefault(kind.name, TypeReport())
        entry.tensors += 1
        entry.file_bytes += file_bytes
        if isinstance(held, GroupedQuant):
            entry.held_bytes += held.nbytes()
            entry.held_as = kind.name if kind in SPECS else CONVERT_TO.name
        else:
            entry.held_bytes += held.numel() * held.element_size()
            entry.held_as = str(held.dtype).removeprefix("torch.")
        return entry

    @property
    def held_bytes(self) -> int:
        """Every tensor's held bytes."""
        return sum(t.held_bytes for t in self.types.values())

    @property
    def file_bytes(self) -> int:
        """Every tensor's bytes in the file."""
        return sum(t.file_bytes for t in self.types.values())

    def to_json(self) -> dict[str, Any]:
        """As `stats()` shows it."""
        return {
            "held_bytes": self.held_bytes,
            "file_bytes": self.file_bytes,
            "types": {name: t.to_json() for name, t in sorted(self.types.items())},
        }


def q4_blocks(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, int]) -> QuantizedWeight:
    """Q4_0 / Q4_1 rows as int4 groups: w = q * d + m (Q4_1), w = (q - 8) * d (Q4_0), q in 0..15."""
    rows, cols = shape
    blocks = np.ascontiguousarray(data).reshape(rows, cols // INT4_GROUP_SIZE, _Q4[kind])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == GGMLQuantizationType.Q4_1:
        m, qs = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32), blocks[..., 4:]
    else:
        m, qs = -8 * d, blocks[..., 2:]
    # A block's byte j holds element j in its low nibble and element j + 16 in its high one.
    q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, cols)
    return QuantizedWeight(
        "int4",
        pack_int4(torch.from_numpy(q)),
        torch.from_numpy(d),
        torch.from_numpy(m),
    )


_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor; ModelLoadError for names we do not know."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _BLOCK_NAME.match(gguf_name)
    if match is None or match.group(2) not in _BLOCK:
        raise ModelLoadError(f"unexpected tensor {gguf_name!r} in GGUF file")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK[part]}.{kind}"


def unpermute_rotary_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Invert llama.cpp's interleaving of each head's rotary halves (rows of a Q or K weight or bias)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(
    file: GGUFFile,
    config: ModelConfig,
    keep: Keep = "float",
    dtype: torch.dtype = torch.float32,
    report: WeightReport | None = None,
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight | GroupedQuant]]:
    """Yield (HF name, tensor) for every tensor in the file. `keep` "gguf": quantized 2-D tensors as their
    blocks (`GroupedQuant`), float ones in `dtype`; "int4": Q4_0/Q4_1 projections as int4, the rest float32;
    "float": everything float32. `report` counts what is held per type."""
    qwen35 = config.architecture == "qwen3_5"
    for tensor in file.reader.tensors:
        mapped = qwen35_hf_name(tensor.name, config) if qwen35 else hf_name(tensor.name)
        if mapped is None:
            continue
        name = mapped
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        kind = GGMLQuantizationType(tensor.tensor_type)
        weight: torch.Tensor | QuantizedWeight | GroupedQuant
        try:
            if keep == "int4" and kind in _Q4 and _PROJECTION.match(tensor.name):
                weight = q4_blocks(tensor.data, kind, (shape[0], shape[1]))
            elif keep == "gguf" and held_kind(kind, tensor.shape.tolist()) != "float":
                weight = _grouped(tensor.data, kind, rows_cols(tensor.shape.tolist()), tensor.name, report)
            else:
                weight = _dequantized(tensor.data, kind, shape, tensor.name, file)
            if qwen35 and needs_float(name):
                if not isinstance(weight, torch.Tensor) or kind not in _FLOAT:
                    raise ModelLoadError(
                        f"tensor {tensor.name!r} in {file.path} is quantized; llama.cpp keeps it float"
                    )
                weight = qwen35_tensor(name, weight)  # in float32, before any cast
            if keep == "gguf" and isinstance(weight, torch.Tensor):
                weight = weight.to(dtype)  # held at the compute dtype
        except ModelLoadError:
            raise
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"tensor {tensor.name!r} in {file.path} has type {kind.name}, "
                "which swarmkv can neither keep nor dequantize"
            ) from exc
        except Exception as exc:  # a truncated file surfaces here as a short buffer
            raise ModelLoadError(f"cannot read tensor {tensor.name!r} from {file.path}: {exc}") from exc
        if keep == "gguf" and report is not None:
            assert not isinstance(weight, QuantizedWeight)
            report.add(kind, int(tensor.n_bytes), weight)
        # Only the "llama" GGUF layout interleaves rotary halves; Qwen files keep the HF (neox) order.
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute(weight, config.num_heads)
        elif config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute(weight, config.num_kv_heads)
        yield name, weight


def _dequantized(
    data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, ...], name: str, file: GGUFFile
) -> torch.Tensor:
    values = dequantize(data, kind)
    if values.size != int(np.prod(shape)):
        raise ModelLoadError(f"tensor {name!r} in {file.path} holds {values.size} values, expected {shape}")
    return torch.tensor(values.reshape(shape), dtype=torch.float32)


def _grouped(
    data: np.ndarray,
    kind: GGMLQuantizationType,
    shape: tuple[int, int],
    name: str,
    report: WeightReport | None,
) -> GroupedQuant:
    """A quantized tensor in the grouped layout: its own blocks when the layout holds its type, else converted
    to Q8_0 (`gguf_held.held_kind` sends tensors whose rows are not whole groups of 32 to float instead), the
    error logged and reported."""
    if kind in SPECS:
        return parse_blocks(data, kind, shape)
    from swarmkv.models.gguf_quantize import quantize

    exact = torch.from_numpy(np.ascontiguousarray(dequantize(data, kind).reshape(shape), dtype=np.float32))
    converted = parse_blocks(quantize(exact, CONVERT_TO), CONVERT_TO, shape)
    error = (converted.dequantize() - exact).abs().max().item()
    relative = error / max(exact.abs().max().item(), 1e-30)
    log.warning(
        "%s: %s is not held by the grouped layout; converted to %s, max abs error %.3g (%.3g relative)",
        name,
        kind.name,
        CONVERT_TO.name,
        error,
        relative,
    )
    if report is not None:
        entry = report.types.setdefault(kind.name, TypeReport())
        entry.max_abs_error = max(entry.max_abs_error, error)
        entry.max_relative_error = max(entry.max_relative_error, relative)
    return converted


def _unpermute(
    weight: torch.Tensor | QuantizedWeight | GroupedQuant, num_heads: int
) -> torch.Tensor | QuantizedWeight | GroupedQuant:
    if isinstance(weight, torch.Tensor):
        return unpermute_rotary_rows(weight, num_heads)
    if isinstance(weight, GroupedQuant):  # rows move whole, with their own codes and constants
        order = unpermute_rotary_rows(torch.arange(weight.shape[0]), num_heads)
        return weight.take_rows(order)
    # The permutation moves whole rows, and quantized rows carry their own group constants.
    mins = None if weight.mins is None else unpermute_rotary_rows(weight.mins, num_heads)
    return QuantizedWeight(
        weight.format,
        unpermute_rotary_rows(weight.qweight, num_heads),
        unpermute_rotary_rows(weight.scales, num_heads),
        mins,
    )
