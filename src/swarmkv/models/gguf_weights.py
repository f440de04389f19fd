"""Read GGUF tensors as Hugging Face-named float tensors, undoing llama.cpp's Q/K row permutation."""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf.quants import dequantize

from swarmkv.config import ModelConfig
from swarmkv.errors import ModelLoadError
from swarmkv.models.gguf_file import GGUFFile

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


def gguf_tensors(file: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, float32 tensor) for every tensor in the file."""
    for tensor in file.reader.tensors:
        name = hf_name(tensor.name)
        try:
            data = dequantize(tensor.data, tensor.tensor_type)
        except Exception as exc:  # a truncated file surfaces here as a short buffer
            raise ModelLoadError(f"cannot read tensor {tensor.name!r} from {file.path}: {exc}") from exc
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if data.size != int(np.prod(shape)):
            raise ModelLoadError(
                f"tensor {tensor.name!r} in {file.path} holds {data.size} values, expected {shape}"
            )
        weight = torch.tensor(data.reshape(shape), dtype=torch.float32)
        # Only the "llama" GGUF layout interleaves rotary halves; Qwen files keep the HF (neox) order.
        if config.architecture == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            weight = unpermute_rotary_rows(weight, config.num_heads)
        elif config.architecture == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            weight = unpermute_rotary_rows(weight, config.num_kv_heads)
        yield name, weight
