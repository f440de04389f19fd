"""Qwen3.5's Gated DeltaNet layer: projections and gates here; the conv window and the recurrent state belong
to each sequence, so the backend carries them (`RecurrentBackend`), as it carries KV for attention layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from swarmkv.config import LinearAttentionShape
from swarmkv.models.attention import AttentionBackend, RecurrentBackend
from swarmkv.models.gated_delta import gated_rms_norm
from swarmkv.models.quantized import WeightFormat, make_linear


class ConvWeight(nn.Module):
    """The depthwise causal conv's taps [channels, 1, kernel] (the checkpoint's conv1d.weight layout)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedRMSNorm(nn.Module):
    """RMSNorm of the delta rule's output per value head, times SiLU of the output gate."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """Linear attention with a gated delta rule: fused input projections (q, k, v | output gate z, and beta's
    logit b | decay's logit a), a causal conv over q, k, v, the delta rule, a gated norm, the output."""

    def __init__(
        self, shape: LinearAttentionShape, hidden_size: int, eps: float, layer: int, weights: WeightFormat
    ) -> None:
        """`layer`: this layer's index among the model's linear-attention layers (its state's index)."""
        super().__init__()
        self.shape = shape
        self.layer = layer
        heads = shape.num_value_heads
        self.split_sizes = [shape.conv_dim, shape.value_dim]
        self.in_proj = make_linear(hidden_size, sum(self.split_sizes), False, weights)
        # beta's and the decay's logits stay float whatever the weight format: a few rows that set every
        # token's write strength and forgetting rate.
        # Float unless the weights are a GGUF file's own (a file may quantize it like any projection).
        self.in_proj_ba = make_linear(hidden_size, 2 * heads, False, "gguf" if weights == "gguf" else "float")
        self.conv1d = ConvWeight(shape.conv_dim, shape.conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))  # the per-head decay rate is exp(A_log)
        self.norm = GatedRMSNorm(shape.value_head_dim, eps)
        self.out_proj = make_linear(shape.value_dim, hidden_size, False, weights)

    def forward(self, x: torch.Tensor, backend: AttentionBackend) -> torch.Tensor:
        assert isinstance(backend, RecurrentBackend), "a hybrid model needs a backend that carries state"
        shape, num_tokens = self.shape, x.shape[0]
        mixed, z = self.in_proj(x).split(self.split_sizes, dim=-1)
        b, a = self.in_proj_ba(x).chunk(2, dim=-1)
        mixed = backend.conv(self.layer, mixed, self.conv1d.weight[:, 0])
        q, k, v = mixed.split([shape.key_dim, shape.key_dim, shape.value_dim], dim=-1)
        # The decay in log space, at least float32: exp(A_log) spans orders of magnitude.
        wide = torch.promote_types(x.dtype, torch.float32)
        g = -self.A_log.to(wide).exp() * F.softplus(a.to(wide) + self.dt_bias.to(wide))
        q = q.reshape(num_tokens, shape.num_key_heads, shape.key_head_dim)
        k = k.reshape(num_tokens, shape.num_key_heads, shape.key_head_dim)
        if shape.value_heads_tiled:
            # Value head j reads key head j % num_key_heads: tiled out to one key head per value head, q and
            # k meet the delta rule's grouped reading (groups of one).
            tiles = shape.num_value_heads // shape.num_key_heads
            q, k = q.repeat(1, tiles, 1), k.repeat(1, tiles, 1)
        core = backend.delta_rule(
            self.layer,
            q,
            k,
            v.reshape(num_tokens, shape.num_value_heads, shape.value_head_dim),
            g,
            b.sigmoid(),
        )
        heads = core.reshape(-1, shape.value_head_dim)
        out = self.norm(heads, z.reshape(-1, shape.value_head_dim))
        return self.out_proj(out.reshape(num_tokens, shape.value_dim))
