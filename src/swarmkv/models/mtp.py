"""Qwen3.5's multi-token-prediction (MTP, "NextN") layer: a draft head that predicts the token after next.

At position p it takes the decoder's last hidden state there (after the final norm) and the embedding of the
token at p + 1, normalises each, projects their concatenation back to the hidden size, runs one gated-attention
decoder layer (its own KV slab, after the decoder's) and a final norm; the model's LM head then scores the
token at p + 2. Chained on its own output (its normed hidden state in place of the decoder's) it drafts
further, as vLLM and llama.cpp chain it. The checkpoint names are Hugging Face's `mtp.*` (llama.cpp's
converter writes them as a block after the decoder's: `models/gguf_qwen35.py` maps them back).
"""

from __future__ import annotations

import torch
from torch import nn

from swarmkv.config import ModelConfig
from swarmkv.errors import UnsupportedModelError
from swarmkv.models.attention import AttentionBackend
from swarmkv.models.layers import TORCH_OPS, LayerOps, RMSNorm
from swarmkv.models.quantized import WeightFormat, make_linear


class MTPHead(nn.Module):
    """The MTP layer; it shares the decoder's embedding and LM head (neither is its own)."""

    def __init__(self, config: ModelConfig, layer: nn.Module, weights: WeightFormat = "float") -> None:
        """`layer`: its decoder layer, gated attention on the KV slab after the decoder's (the decoder builds
        it, as it builds its own)."""
        super().__init__()
        if config.mtp_layers != 1:
            raise UnsupportedModelError(
                f"the checkpoint has {config.mtp_layers} MTP layers; swarmkv drafts with exactly one, as "
                "Qwen3.5 ships it"
            )
        hidden = config.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(hidden, config.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden, config.rms_norm_eps)
        self.fc = make_linear(2 * hidden, hidden, False, weights)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        ops: LayerOps = TORCH_OPS,
    ) -> torch.Tensor:
        """Normed hidden states [T, hidden] from the next tokens' embeddings and the previous hidden states
        (each [T, hidden]) at `positions`: the LM head's input, and the next chained step's hidden state."""
        x = torch.cat([self.pre_fc_norm_embedding(embeds, ops), self.pre_fc_norm_hidden(hidden, ops)], dim=-1)
        x, residual = self.fc(x), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, backend, ops)
        assert residual is not None
        return self.norm.add(x, residual, ops)[0]
