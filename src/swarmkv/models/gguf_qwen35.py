"""llama.cpp's `qwen35` GGUF tensors as the Hugging Face Qwen3.5 tensors `hf_target` maps.

What llama.cpp's converter (`conversion/qwen.py`: `Qwen3NextModel.modify_tensors`, then
`_LinearAttentionVReorderBase.modify_tensors` for `Qwen3_5TextModel`) changes, and what is undone here:
- A_log is stored as ssm_a = -exp(A_log): A_log = log(-ssm_a) again (one rounding, in float64).
- conv1d.weight [C, 1, K] is squeezed to [C, K]: the middle axis is put back.
- The RMSNorms that scale by 1 + w (all but the gated ssm_norm) are stored as 1 + w: w = stored - 1, so
  `hf_target`'s own +1 is not applied twice ((1 + w) - 1 is exact in float32 for |w| <= 1/2).
- dt_bias is renamed ssm_dt.bias; the tensor is unchanged.
- The linear-attention value heads are reordered from grouped to tiled (`_reorder_v_heads`): the V rows of
  in_proj_qkv, the rows of in_proj_z, in_proj_a and in_proj_b, A_log, dt_bias, conv1d's V channels, and
  out_proj's input columns. Not undone: columns of a row-quantized weight cannot move, so the model runs
  in the tiled order (`LinearAttentionShape.value_heads_tiled`). Every 2-D weight is taken as stored.
"""

from __future__ import annotations

import re

import torch

from swarmkv.config import ModelConfig
from swarmkv.errors import ModelLoadError

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # gated full attention: attn_q holds each head's query and output gate, as q_proj does
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    # Gated DeltaNet
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
# The MTP block's own tensors (llama.cpp's names for Hugging Face's `mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`).
_NEXTN = {
    "nextn.eh_proj.weight": "mtp.fc.weight",
    "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
    "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
    "nextn.shared_head_norm.weight": "mtp.norm.weight",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(.+)$")
# Stored as 1 + w by the converter (every `norm.weight` but the linear attention's gated norm).
_SHIFTED_NORMS = re.compile(
    r"^(model\.norm|(model|mtp)\.layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm)"
    r"|mtp\.(norm|pre_fc_norm_embedding|pre_fc_norm_hidden))\.weight$"
)


def qwen35_hf_name(gguf_name: str, config: ModelConfig) -> str | None:
    """The Hugging Face name of a qwen35 GGUF tensor: the multi-token-prediction block after the decoder's
    own layers maps to `mtp.*` where the config runs it (`ModelConfig.with_mtp`), else to None (not held);
    ModelLoadError for names we do not know."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    match = _BLOCK_NAME.match(gguf_name)
    if match is None:
        raise ModelLoadError(f"unexpected tensor {gguf_name!r} in qwen35 GGUF file")
    block, name = int(match.group(1)), match.group(2)
    prefix = "model"
    if block >= config.num_layers:
        if not config.mtp_layers:
            return None
        if name in _NEXTN:
            return _NEXTN[name]
        prefix, block = "mtp", block - config.num_layers
    if name not in _BLOCK:
        raise ModelLoadError(f"unexpected tensor {gguf_name!r} in qwen35 GGUF file")
    return f"{prefix}.layers.{block}.{_BLOCK[name]}"


def needs_float(hf_name: str) -> bool:
    """Whether `qwen35_tensor` computes on this tensor (so it must arrive as float, not quantized)."""
    return hf_name.endswith(("linear_attn.A_log", "linear_attn.conv1d.weight")) or bool(
        _SHIFTED_NORMS.match(hf_name)
    )


def qwen35_tensor(hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Undo the converter's arithmetic on one small float tensor (see the module docstring); any other
    tensor is returned as it is."""
    if hf_name.endswith("linear_attn.A_log"):
        if bool((tensor >= 0).any()):
            raise ModelLoadError(f"{hf_name} (ssm_a = -exp(A_log)) has values >= 0; the file is damaged")
        return (-tensor.double()).log().to(tensor.dtype)
    if hf_name.endswith("linear_attn.conv1d.weight"):
        return tensor.unsqueeze(1)
    if _SHIFTED_NORMS.match(hf_name):
        return tensor - 1
    return tensor
