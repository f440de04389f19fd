"""The runner's fast path for a step's decodes on the CPU: a dense decoder held at its GGUF bits, described
once to the whole-step C decode (`kernels/cpu_decode.py`), which reads the runner's own KV slabs and page table.
Models it cannot describe (hybrids, an attention output gate, partial rotary, KV stored other than float32 or
float16, weights in another format) keep the torch modules; `why_not` says which."""

from __future__ import annotations

import torch

from swarmkv.choices import CPU_INT8_RESIDUAL_GROUPS
from swarmkv.engine.kv_cache import KVCache
from swarmkv.engine.page_table import PageTable
from swarmkv.kernels import cpu_decode, cpu_grouped
from swarmkv.models.decoder import DecoderForCausalLM, DecoderLayer, SelfAttention
from swarmkv.models.gguf_linear import GGUFEmbedding, GGUFLinear


def why_not(model: DecoderForCausalLM, kv_cache: KVCache, device: torch.device) -> str | None:
    """Why the C decode step cannot run this model over these KV pages (None: it can)."""
    reason = _model_why_not(model, device)
    if reason is not None:
        return reason
    if kv_cache.dtype != torch.float32:
        return "the model does not compute in float32"
    half = kv_cache.storage_dtype == torch.float16 and cpu_decode.reads_half_kv()
    if kv_cache.storage_dtype != torch.float32 and not half:
        return "KV pages are neither float32 nor float16 (float16 needs F16C)"
    return None


def auto_kv_dtype(model: DecoderForCausalLM, dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """The page dtype `kv_cache_dtype="auto"` takes where the C step will decode: float16 under a float32 model,
    as llama.cpp keeps its KV (half the bytes each decode step reads); None elsewhere (the model's dtype)."""
    if dtype != torch.float32 or _model_why_not(model, device) is not None or not cpu_decode.reads_half_kv():
        return None
    return torch.float16


def _model_why_not(model: DecoderForCausalLM, device: torch.device) -> str | None:
    config = model.config
    if device.type != "cpu":
        return "not on the CPU"
    if cpu_grouped.library() is None:
        return "the CPU kernels are not built"
    if model.weights != "gguf":
        return f"weights are {model.weights!r}, not held at their GGUF bits"
    if config.is_hybrid or config.attn_output_gate or config.rotary_dim != config.head_dim:
        return "a hybrid, gated or partial-rotary model"
    if config.head_dim % 16 or config.head_dim > 256 or config.num_heads // config.num_kv_heads > 16:
        return (
            "a head size the C attention does not take (a multiple of 16 up to 256, 16 query heads a KV head)"
        )
    linears = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    blocks = [b.weight for m in linears for b in m.blocks]
    blocks += [b.weight for b in model.embed_tokens.blocks]  # type: ignore[union-attr]
    if not all(cpu_decode.supports_block(b) for b in blocks):
        return "a weight block the C kernel does not read"
    return None


def describe(
    model: DecoderForCausalLM,
    kv_cache: KVCache,
    page_table: PageTable,
    int8_activations: bool,
    residual_groups: int = CPU_INT8_RESIDUAL_GROUPS,
) -> cpu_decode.DecodeModel:
    """The model, its KV slabs and page table as the C decode step reads them (after `why_not` said None)."""
    config = model.config
    layers = []
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        attn = layer.self_attn
        assert isinstance(attn, SelfAttention)
        layers.append(
            cpu_decode.Layer(
                input_norm=layer.input_layernorm.weight,
                post_norm=layer.post_attention_layernorm.weight,
                q_norm=None if attn.q_norm is None else attn.q_norm.weight,
                k_norm=None if attn.k_norm is None else attn.k_norm.weight,
                qkv=_linear(attn.qkv_proj),
                o=_linear(attn.o_proj),
                gate_up=_linear(layer.mlp.gate_up_proj),
                down=_linear(layer.mlp.down_proj),
            )
        )
    embed = model.embed_tokens
    assert isinstance(embed, GGUFEmbedding)
    assert model.rotary.cos_sin is not None, "the rotary table is built with the model"
    shape = cpu_decode.Shape(
        hidden=config.hidden_size,
        heads=config.num_heads,
        kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        intermediate=config.intermediate_size,
        vocab=config.vocab_size,
        eps=config.rms_norm_eps,
    )
    return cpu_decode.DecodeModel(
        shape,
        layers,
        cpu_decode.Linear(
            embed.embedding_dim, embed.num_embeddings, [(b.start, b.weight) for b in embed.blocks]
        ),
        model.norm.weight,
        _linear(model.lm_head),
        model.rotary.cos_sin.contiguous(),
        kv_cache.k,
        kv_cache.v,
        page_table.host,
        page_table.page_size,
        int8_activations,
        residual_groups,
    )


def _linear(module: object) -> cpu_decode.Linear:
    assert isinstance(module, GGUFLinear)
    bias = None if module.bias is None else module.bias.detach()
    return cpu_decode.Linear(
        module.in_features, module.out_features, [(b.start, b.weight) for b in module.blocks], bias
    )
