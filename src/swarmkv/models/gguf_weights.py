"""Read GGUF tensors as Hugging Face-named tensors, undoing llama.cpp's Q/K row permutation (and, for qwen35,
the converter's arithmetic on small tensors: `gguf_qwen35`): float, or Q4_0 and Q4_1 projection weights kept
as int4 groups of 32 (their blocks are exactly such groups)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from swarmkv.config import ModelConfig
from swarmkv.errors import ModelLoadError
from swarmkv.kernels.reference import pack_int4
from swarmkv.models.gguf_file import GGUFFile
from swarmkv.models.gguf_qwen35 import needs_float, qwen35_hf_name, qwen35_tensor
from swarmkv.models.quantized import INT4_GROUP_SIZE, QuantizedWeight, WeightFormat

_Q4 = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20}  # bytes per block of 32
_FLOAT = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
# qwen35's linear attention adds attn_qkv, attn_gate and ssm_out (its ssm_alpha and ssm_beta stay float).
_PROJECTION = re.compile(
    r"^blk\.\d+\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down|attn_qkv|attn_gate|ssm_out)\.weight$"
)


def auto_weight_format(file: GGUFFile) -> WeightFormat:
    """The format that keeps a file's projection weights at their precision: int4 when all are Q4_0/Q4_1
    (exact), float when all are float, int8 otherwise (Q8_0 and K-quants, requantized per channel)."""
    kinds = {t.tensor_type for t in file.reader.tensors if _PROJECTION.match(t.name)}
    if kinds and kinds <= set(_Q4):
        return "int4"
    if kinds <= _FLOAT:
        return "float"
    return "int8"


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
    file: GGUFFile, config: ModelConfig, keep_int4: bool = False
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield (HF name, tensor) for every tensor in the file: float32, except Q4_0/Q4_1 projection weights,
    which stay int4 when `keep_int4`."""
    qwen35 = config.architecture == "qwen3_5"
    for tensor in file.reader.tensors:
        mapped = qwen35_hf_name(tensor.name, config) if qwen35 else hf_name(tensor.name)
        if mapped is None:
            continue
        name = mapped
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        weight: torch.Tensor | QuantizedWeight
        try:
            if keep_int4 and tensor.tensor_type in _Q4 and _PROJECTION.match(tensor.name):
                weight = q4_blocks(tensor.data, tensor.tensor_type, (shape[0], shape[1]))
            else:
                data = dequantize(tensor.data, tensor.tensor_type)
                if data.size != int(np.prod(shape)):
                    raise ModelLoadError(
                        f"tensor {tensor.name!r} in {file.path} holds {data.size} values, expected {shape}"
                    )
                weight = torch.tensor(data.reshape(shape), dtype=torch.float32)
        except ModelLoadError:
            raise
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"tensor {tensor.name!r} in {file.path} has type {tensor.tensor_type.name}, "
                "which swarmkv can neither keep nor dequantize"
            ) from exc
        except Exception as exc:  # a truncated file surfaces here as a short buffer
            raise ModelLoadError(f"cannot read tensor {tensor.name!r} from {file.path}: {exc}") from exc
        if qwen35 and needs_float(name):
            if not isinstance(weight, torch.Tensor):
                raise ModelLoadError(
                    f"tensor {tensor.name!r} in {file.path} is quantized; llama.cpp keeps it float"
                )
            weight = qwen35_tensor(name, weight)
        # Only the "llama" GGUF layout interleaves rotary halves; Qwen files keep the HF (neox) order.
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = _unpermute(weight, config.num_heads)
        elif config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = _unpermute(weight, config.num_kv_heads)
        yield name, weight


def _unpermute(weight: torch.Tensor | QuantizedWeight, num_heads: int) -> torch.Tensor | QuantizedWeight:
    if isinstance(weight, torch.Tensor):
        return unpermute_rotary_rows(weight, num_heads)
    # The permutation moves whole rows, and quantized rows carry their own group constants.
    mins = None if weight.mins is None else unpermute_rotary_rows(weight.mins, num_heads)
    return QuantizedWeight(
        weight.format,
        unpermute_rotary_rows(weight.qweight, num_heads),
        unpermute_rotary_rows(weight.scales, num_heads),
        mins,
    )
