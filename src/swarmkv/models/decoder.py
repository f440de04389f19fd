"""The decoder used by Llama, Mistral, Qwen2, Qwen3 and Qwen3.5: they differ in q/k norm, QKV bias, the
attention output gate and partial rotary, and Qwen3.5 puts Gated DeltaNet layers between its attention layers."""

from __future__ import annotations

import torch
from torch import nn

from swarmkv.config import LINEAR_ATTENTION, ModelConfig
from swarmkv.models.attention import AttentionBackend, StoresKV
from swarmkv.models.layers import TORCH_OPS, GatedMLP, LayerOps, RMSNorm, RotaryEmbedding
from swarmkv.models.linear_attention import GatedDeltaNet
from swarmkv.models.mtp import MTPHead
from swarmkv.models.quantized import WeightFormat, make_linear


class SelfAttention(nn.Module):
    """Fused-QKV grouped-query attention; the KV handling is the backend's business. With an output gate,
    q_proj's rows hold each head's query followed by its gate."""

    def __init__(
        self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, weights: WeightFormat = "float"
    ) -> None:
        """`layer`: this layer's index among the model's attention layers (its KV slab)."""
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.gated = config.attn_output_gate
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.split_sizes = [q_size * (2 if self.gated else 1), kv_size, kv_size]
        self.qkv_proj = make_linear(config.hidden_size, sum(self.split_sizes), config.attention_bias, weights)
        self.o_proj = make_linear(q_size, config.hidden_size, False, weights)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend, ops: LayerOps
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        # q, k and v stay views of the fused output: the ops read them through their strides.
        q, k, v = self.qkv_proj(x).split(self.split_sizes, dim=-1)
        gate = None
        if self.gated:
            q, gate = q.view(num_tokens, self.num_heads, 2 * self.head_dim).split(self.head_dim, dim=-1)
        else:
            q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q_weight, k_weight, eps = None, None, 0.0
        if self.q_norm is not None and self.k_norm is not None:
            q_weight, k_weight, eps = self.q_norm.weight, self.k_norm.weight, self.q_norm.eps
        rotation = (self.rotary.table(), q_weight, k_weight, eps)
        if ops.qk_norm_rotary_store is not None and isinstance(backend, StoresKV):
            q = ops.qk_norm_rotary_store(positions, q, k, v, *rotation, backend.kv_slabs(self.layer))
            out = backend.attend_stored(self.layer, q)
        else:
            q, k = ops.qk_norm_rotary(positions, q, k, *rotation)
            out = backend.attend(self.layer, q, k, v)
        out = out.reshape(num_tokens, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(num_tokens, -1))
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    """Pre-norm token mixer (attention, or Gated DeltaNet in a hybrid) followed by a pre-norm SwiGLU block.
    The residual stream is carried beside the block outputs, so each residual add is fused into the norm
    that follows it."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        rotary: RotaryEmbedding,
        weights: WeightFormat = "float",
        linear: bool = False,
    ) -> None:
        """`layer`: the index among layers of the same kind (attention or linear attention)."""
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn: SelfAttention | None = None
        self.linear_attn: GatedDeltaNet | None = None
        if linear:
            assert config.linear is not None
            self.linear_attn = GatedDeltaNet(
                config.linear, config.hidden_size, config.rms_norm_eps, layer, weights
            )
        else:
            self.self_attn = SelfAttention(config, layer, rotary, weights)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, weights)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        backend: AttentionBackend,
        ops: LayerOps,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this block's MLP output, the residual stream before it is added)."""
        if residual is None:
            x, residual = self.input_layernorm(x, ops), x
        else:
            x, residual = self.input_layernorm.add(x, residual, ops)
        if self.self_attn is not None:
            x = self.self_attn(x, positions, backend, ops)
        else:
            assert self.linear_attn is not None
            x = self.linear_attn(x, backend)
        x, residual = self.post_attention_layernorm.add(x, residual, ops)
        return self.mlp(x, ops), residual


class DecoderForCausalLM(nn.Module):
    """Token ids in, last-layer hidden states out; logits only for the rows asked for."""

    def __init__(self, config: ModelConfig, weights: WeightFormat = "float") -> None:
        """`weights`: the format of every projection in the layers; embeddings and LM head stay float, except in
        the "gguf" format, where they too hold the file's blocks."""
        super().__init__()
        config.require_runnable()
        self.config = config
        self.weights = weights
        self.rotary = RotaryEmbedding(
            config.rotary_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        self.embed_tokens: nn.Module
        self.lm_head: nn.Module
        if weights == "gguf":
            from swarmkv.models.gguf_linear import GGUFEmbedding, GGUFLinear

            self.embed_tokens = GGUFEmbedding(config.vocab_size, config.hidden_size)
            self.lm_head = GGUFLinear(config.hidden_size, config.vocab_size, bias=False)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        kinds = config.layer_types or ("full_attention",) * config.num_layers
        linear = [kind == LINEAR_ATTENTION for kind in kinds]
        # Each layer's index among its own kind: attention layers index KV slabs, linear ones state slabs.
        ordinals = [
            sum(1 for other in linear[:i] if other == is_linear) for i, is_linear in enumerate(linear)
        ]
        self.layers = nn.ModuleList(
            DecoderLayer(config, ordinal, self.rotary, weights, is_linear)
            for ordinal, is_linear in zip(ordinals, linear, strict=True)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Qwen3.5's MTP draft layer, where the config runs it (`ModelConfig.with_mtp`): its attention on the KV
        # slab after the decoder's own.
        self.mtp: MTPHead | None = None
        if config.mtp_layers:
            slab = config.num_decoder_attention_layers
            self.mtp = MTPHead(config, DecoderLayer(config, slab, self.rotary, weights), weights)

    def tie_weights(self) -> None:
        """Point the LM head at the embedding matrix when the checkpoint ties them."""
        if not self.config.tie_word_embeddings:
            return
        if self.weights == "gguf":
            self.lm_head.share_blocks(self.embed_tokens)  # type: ignore[operator]
        else:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        ops: LayerOps = TORCH_OPS,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] for a flat batch of T tokens."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, backend, ops)
        assert residual is not None, "a decoder has at least one layer"
        return self.norm.add(x, residual, ops)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the hidden rows given."""
        return self.lm_head(hidden).float()
