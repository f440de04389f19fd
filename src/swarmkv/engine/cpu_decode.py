"""The runner's fast path for a step's decodes on the CPU: a decoder held at its GGUF bits (dense, or Qwen3.5's
hybrid of Gated DeltaNet and gated attention), described once to the whole-step C decode
(`kernels/cpu_decode.py`), which reads the runner's own KV slabs, page table and state slots. Models it cannot
describe (KV stored other than float32 or float16, weights in another format, head sizes past its limits) keep
the torch modules; `why_not` says which. A hybrid's speculative chunks run in the step too: `draft_positions` says
which rows keep their states, and `keep_positions` hands what the step kept to the `StateCache` for the rewind."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarmkv.choices import CPU_INT8_RESIDUAL_GROUPS
from swarmkv.config import ModelConfig
from swarmkv.core.scheduler import Chunk
from swarmkv.engine.kv_cache import KVCache
from swarmkv.engine.page_table import PageTable
from swarmkv.engine.state_cache import StateCache
from swarmkv.kernels import cpu_decode, cpu_grouped
from swarmkv.models.decoder import DecoderForCausalLM, DecoderLayer, SelfAttention
from swarmkv.models.gguf_linear import GGUFEmbedding, GGUFLinear
from swarmkv.models.linear_attention import GatedDeltaNet

MAX_HEAD_DIM = 256  # decode.c's bound on an attention head and a Gated DeltaNet key or value head


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
    if config.head_dim % 16 or config.head_dim > MAX_HEAD_DIM or config.num_heads // config.num_kv_heads > 16:
        return (
            "a head size the C attention does not take (a multiple of 16 up to 256, 16 query heads a KV head)"
        )
    if config.rotary_dim % 2:
        return "an odd number of rotary dims"
    shape = config.linear
    if config.is_hybrid and (
        shape is None
        or max(shape.key_head_dim, shape.value_head_dim) > MAX_HEAD_DIM
        or shape.num_value_heads % shape.num_key_heads
    ):
        return "a Gated DeltaNet head size past the C step's 256, or value heads not a multiple of key heads"
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
    states: StateCache | None = None,
) -> cpu_decode.DecodeModel:
    """The model, its KV slabs, page table and (a hybrid's) state tensors as the C decode step reads them (after
    `why_not` said None)."""
    config = model.config
    assert config.is_hybrid == (states is not None), "a hybrid's step, and only a hybrid's, has state slots"
    layers = []
    for layer in model.layers:
        assert isinstance(layer, DecoderLayer)
        mlp = (_linear(layer.mlp.gate_up_proj), _linear(layer.mlp.down_proj))
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        if layer.linear_attn is not None:
            assert states is not None
            layers.append(_delta_layer(layer.linear_attn, states, norms, mlp))
            continue
        attn = layer.self_attn
        assert isinstance(attn, SelfAttention)
        layers.append(
            cpu_decode.Layer(
                input_norm=norms[0],
                post_norm=norms[1],
                q_norm=None if attn.q_norm is None else attn.q_norm.weight,
                k_norm=None if attn.k_norm is None else attn.k_norm.weight,
                qkv=_linear(attn.qkv_proj),
                o=_linear(attn.o_proj),
                gate_up=mlp[0],
                down=mlp[1],
                kv=attn.layer,
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
        attn_gate=config.attn_output_gate,
        delta=None if config.linear is None else _delta_shape(config),
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


def _delta_shape(config: ModelConfig) -> cpu_decode.DeltaShape:
    shape = config.linear
    assert shape is not None
    return cpu_decode.DeltaShape(
        key_heads=shape.num_key_heads,
        value_heads=shape.num_value_heads,
        key_dim=shape.key_head_dim,
        value_dim=shape.value_head_dim,
        conv_kernel=shape.conv_kernel,
        tiled=shape.value_heads_tiled,
    )


def _delta_layer(
    mixer: GatedDeltaNet,
    states: StateCache,
    norms: tuple[torch.Tensor, torch.Tensor],
    mlp: tuple[cpu_decode.Linear, cpu_decode.Linear],
) -> cpu_decode.Layer:
    """A Gated DeltaNet layer: in_proj as the layer's qkv, out_proj as its o; in_proj_ba's rows follow in_proj's
    in the C step (one pass over x for both)."""
    in_proj, ba = _linear(mixer.in_proj), _linear(mixer.in_proj_ba)
    fused = cpu_decode.Linear(
        in_proj.in_features,
        in_proj.out_features + ba.out_features,
        in_proj.blocks + [(start + in_proj.out_features, block) for start, block in ba.blocks],
    )
    assert in_proj.bias is None and ba.bias is None, "Gated DeltaNet projections carry no bias"
    return cpu_decode.Layer(
        input_norm=norms[0],
        post_norm=norms[1],
        q_norm=None,
        k_norm=None,
        qkv=fused,
        o=_linear(mixer.out_proj),
        gate_up=mlp[0],
        down=mlp[1],
        delta=cpu_decode.DeltaNet(
            conv_weight=mixer.conv1d.weight.detach()[:, 0],
            neg_a=-mixer.A_log.detach().float().exp(),
            dt_bias=mixer.dt_bias.detach(),
            norm=mixer.norm.weight.detach(),
            conv_state=states.conv[mixer.layer],
            ssm_state=states.ssm[mixer.layer],
            state_layer=mixer.layer,
        ),
    )


@dataclass(frozen=True)
class DraftPositions:
    """A hybrid step's speculative chunks as the C step keeps their states: the rows' kept positions, and per
    chunk (its slot, its positions, its first kept window, its first kept state). A chunk keeps the window after
    every position and the state after every position but its last, which its slot holds."""

    rows: cpu_decode.KeptRows
    chunks: tuple[tuple[int, int, int, int], ...]


def draft_positions(rows: list[tuple[Chunk, int]], slots: dict[str, int]) -> DraftPositions | None:
    """Where the step rows (chunk, offset in it) keep their states; None where no row is a draft's."""
    firsts: dict[str, tuple[int, int]] = {}
    chunks: list[tuple[int, int, int, int]] = []
    num_conv = num_ssm = 0
    for chunk, _ in rows:
        if chunk.draft and chunk.request_id not in firsts:
            firsts[chunk.request_id] = num_conv, num_ssm
            chunks.append((slots[chunk.request_id], chunk.num_tokens, num_conv, num_ssm))
            num_conv += chunk.num_tokens
            num_ssm += chunk.num_tokens - 1
    if not chunks:
        return None
    conv_index, ssm_index = [], []
    for chunk, j in rows:  # the C step's negative index: nothing kept (conv), the slot only (the state)
        first = firsts.get(chunk.request_id)
        if first is None:
            conv_index.append(-1)
            ssm_index.append(-1)
            continue
        conv_index.append(first[0] + j)
        ssm_index.append(first[1] + j if j < chunk.num_tokens - 1 else -1)
    kept = cpu_decode.KeptRows(
        torch.tensor(conv_index, dtype=torch.int64),
        torch.tensor(ssm_index, dtype=torch.int64),
        num_conv,
        num_ssm,
    )
    return DraftPositions(kept, tuple(chunks))


def keep_positions(states: StateCache, step: cpu_decode.DecodeModel, drafts: DraftPositions | None) -> None:
    """After a step: each speculative chunk's states after each position, as views of what the step kept (and of
    its slot, for the last), into `states`, as the modules' step keeps them. Every step begins anew, so a chunk
    never rewound (its request ended) is dropped."""
    states.begin_positions([] if drafts is None else [slot for slot, *_ in drafts.chunks])
    if drafts is None:
        return
    conv, ssm = step.kept_states(drafts.rows)
    for slot, length, first_conv, first_ssm in drafts.chunks:
        for layer in range(conv.shape[0]):
            kept = [ssm[layer, first_ssm + j] for j in range(length - 1)] + [states.ssm[layer, slot]]
            states.keep_positions(layer, slot, conv[layer, first_conv : first_conv + length], kept)
