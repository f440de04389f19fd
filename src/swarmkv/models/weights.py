"""Checkpoint tensors -> model parameters: one name mapping, every parameter filled exactly once."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from swarmkv.config import ModelConfig
from swarmkv.errors import ModelLoadError
from swarmkv.models.gguf_linear import GGUFEmbedding, GGUFLinear, gguf_modules
from swarmkv.models.gguf_quants import GroupedQuant, int8_groups
from swarmkv.models.quantized import QuantizedLinear, QuantizedWeight, quantize_int4

# A checkpoint tensor: float, already quantized (GGUF Q4 blocks kept as int4), or a GGUF tensor's own blocks.
CheckpointTensor = torch.Tensor | QuantizedWeight | GroupedQuant

# Hugging Face names (minus the "model." prefix) that land in a slice of one of our fused parameters.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "linear_attn.in_proj_qkv": ("linear_attn.in_proj", 0),
    "linear_attn.in_proj_z": ("linear_attn.in_proj", 1),
    "linear_attn.in_proj_b": ("linear_attn.in_proj_ba", 0),
    "linear_attn.in_proj_a": ("linear_attn.in_proj_ba", 1),
}
_LAYER = re.compile(r"^(model|mtp)\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_LAYER_PARAM = re.compile(r"^model\.layers\.(\d+)\.(linear_attn\.(?:A_log|dt_bias))$")  # bare parameters
_PARAM_IN_LAYER = re.compile(r"^(mtp\.)?layers\.(\d+)\.(.+)\.(weight|bias)$")
# Present in some checkpoints but derived, not learned: safe to skip.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq)$")
# Parts of a multimodal checkpoint that a text decoder does not run.
_OTHER_MODELS = re.compile(r"^model\.visual\.")
# The multi-token-prediction layer's tensors: held where the config runs it (`ModelConfig.with_mtp`).
_MTP = re.compile(r"^(model\.)?mtp\.")
_MTP_OWN = {"fc": False, "pre_fc_norm_embedding": True, "pre_fc_norm_hidden": True, "norm": True}
# Qwen3.5's RMSNorms scale by 1 + weight; ours by weight, so the checkpoint's value is shifted by one.
_ZERO_CENTRED_NORMS = frozenset(
    {"input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"}
)


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: a parameter name and, for fused ones, which shard."""

    param: str
    shard: int | None = None
    offset: float = 0.0  # added to the tensor on load


def hf_target(name: str, config: ModelConfig) -> Target | None:
    """Map a Hugging Face tensor name to our parameter; None for tensors that are skipped on purpose."""
    if _IGNORED.search(name) or _OTHER_MODELS.match(name):
        return None
    if name.startswith("model.language_model."):  # a multimodal checkpoint's text decoder
        name = "model." + name.removeprefix("model.language_model.")
    norm_offset = 1.0 if config.architecture == "qwen3_5" else 0.0
    if _MTP.match(name):
        if not config.mtp_layers:
            return None
        name = name.removeprefix("model.")
        own = _MTP_OWN.get(name.removeprefix("mtp.").rsplit(".", 1)[0])
        if own is not None:  # its projection and norms (all of Qwen3.5's scale by 1 + weight)
            return Target(name, offset=norm_offset if own else 0.0)
    if name == "model.embed_tokens.weight":
        return Target("embed_tokens.weight")
    if name == "model.norm.weight":
        return Target("norm.weight", offset=norm_offset)
    if name == "lm_head.weight":
        # A tied checkpoint may still carry a copy of the embedding; the tie makes it redundant.
        return None if config.tie_word_embeddings else Target("lm_head.weight")
    bare = _LAYER_PARAM.match(name)
    if bare is not None:
        return Target(f"layers.{bare.group(1)}.{bare.group(2)}")
    match = _LAYER.match(name)
    if match is None:
        raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint")
    owner, layer, module, kind = match.groups()
    where = "layers" if owner == "model" else "mtp.layers"
    if module in _FUSED:
        fused, shard = _FUSED[module]
        return Target(f"{where}.{layer}.{fused}.{kind}", shard)
    offset = norm_offset if module in _ZERO_CENTRED_NORMS else 0.0
    return Target(f"{where}.{layer}.{module}.{kind}", offset=offset)


def _shard_sizes(param: str, config: ModelConfig) -> list[int]:
    if "qkv_proj" in param:
        kv = config.num_kv_heads * config.head_dim
        return [config.num_heads * config.head_dim * (2 if config.attn_output_gate else 1), kv, kv]
    if "linear_attn.in_proj_ba" in param:
        assert config.linear is not None
        return [config.linear.num_value_heads] * 2
    if "linear_attn.in_proj" in param:
        assert config.linear is not None
        return [config.linear.conv_dim, config.linear.value_dim]
    return [config.intermediate_size, config.intermediate_size]


def load_weights(
    model: nn.Module, config: ModelConfig, tensors: Iterable[tuple[str, CheckpointTensor]]
) -> None:
    """Copy named HF-layout tensors into `model` (quantizing those bound for quantized layers); fail on any
    missing, unexpected, duplicate or mis-shaped one."""
    params = dict(model.named_parameters(remove_duplicate=True))
    device = next(iter(params.values())).device  # where an int8 layer's quantized codes go
    quantized: dict[str, nn.Module] = {
        f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)
    }
    quantized.update(gguf_modules(model))
    if config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
        quantized.pop("lm_head.weight", None)
    filled: dict[tuple[str, int | None], str] = {}
    for name, tensor in tensors:
        target = hf_target(name, config)
        if target is None:
            continue
        if target.param not in params and target.param not in quantized:
            raise ModelLoadError(f"unexpected tensor {name!r}: the model has no parameter {target.param!r}")
        key = (target.param, target.shard)
        if key in filled:
            raise ModelLoadError(
                f"tensor {name!r} fills {target.param!r} a second time (first: {filled[key]!r})"
            )
        module = quantized.get(target.param)
        if isinstance(module, QuantizedLinear):
            _load_quantized(module, target, name, tensor, config)
        elif module is not None:
            _load_gguf(module, target, name, tensor, config, device)
        else:
            _load_float(params[target.param].data, target, name, tensor, config)
        filled[key] = name
    missing = [name for p in [*params, *quantized] for name in _missing_checkpoint_names(p, filled)]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensor(s): {shown}")


def _rows(target: Target, config: ModelConfig, total: int) -> tuple[int, int]:
    """The first row and row count `target` fills of a parameter with `total` rows."""
    if target.shard is None:
        return 0, total
    sizes = _shard_sizes(target.param, config)
    return sum(sizes[: target.shard]), sizes[target.shard]


def _check_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...], param: str) -> None:
    if shape != expected:
        raise ModelLoadError(f"tensor {name!r} has shape {shape}, expected {expected} for {param!r}")


def _load_float(
    dest: torch.Tensor, target: Target, name: str, tensor: CheckpointTensor, config: ModelConfig
) -> None:
    if isinstance(tensor, GroupedQuant):
        raise ModelLoadError(f"tensor {name!r} is quantized, but {target.param!r} holds only float values")
    assert not isinstance(tensor, QuantizedWeight), "quantized tensors are read only for quantized layers"
    start, rows = _rows(target, config, dest.shape[0])
    dest = dest.narrow(0, start, rows)
    _check_shape(name, tuple(tensor.shape), tuple(dest.shape), target.param)
    dest.copy_(tensor)
    if target.offset:
        dest.add_(target.offset)


def _load_quantized(
    module: QuantizedLinear, target: Target, name: str, tensor: CheckpointTensor, config: ModelConfig
) -> None:
    start, rows = _rows(target, config, module.out_features)
    _check_shape(name, tuple(tensor.shape), (rows, module.in_features), target.param)
    if isinstance(tensor, GroupedQuant):
        raise ModelLoadError(f"tensor {name!r} holds GGUF blocks, but {target.param!r} was built for int4")
    if not isinstance(tensor, QuantizedWeight):
        # Quantization is row-local, so a shard quantized alone equals its rows of the fused matrix.
        tensor = quantize_int4(tensor, module.scales.dtype)
    module.load_rows(start, tensor)


def _load_gguf(
    module: nn.Module,
    target: Target,
    name: str,
    tensor: CheckpointTensor,
    config: ModelConfig,
    device: torch.device,
) -> None:
    """A GGUF tensor (blocks or float) becomes its rows of a GGUF-held layer, as the file holds it; an int8
    layer quantizes a float one where it is and holds the codes on `device`."""
    assert isinstance(tensor, torch.Tensor | GroupedQuant), "GGUF layers take GGUF tensors"
    assert isinstance(module, GGUFLinear | GGUFEmbedding)
    if isinstance(module, GGUFLinear):
        total, cols = module.out_features, module.in_features
    else:
        total, cols = module.num_embeddings, module.embedding_dim
    start, rows = _rows(target, config, total)
    _check_shape(name, tuple(tensor.shape), (rows, cols), target.param)
    if isinstance(module, GGUFLinear) and module.int8_from_float and isinstance(tensor, torch.Tensor):
        # Quantization is row-local, so a shard quantized alone equals its rows of the fused matrix.
        tensor = int8_groups(tensor).to(device)
    module.load_block(start, tensor)


def _missing_checkpoint_names(param: str, filled: dict[tuple[str, int | None], str]) -> list[str]:
    """Checkpoint names that should have filled `param` (or its unfilled shards); empty when it is filled."""
    if (param, None) in filled:
        return []
    if param == "lm_head.weight":
        return [param]
    match = _PARAM_IN_LAYER.match(param)
    if match is None:
        return [f"model.{param}"]
    mtp, layer, module, kind = match.groups()
    shards = {shard: hf for hf, (fused, shard) in _FUSED.items() if fused == module}
    if not shards:
        return [f"model.{param}"]
    owner = "mtp" if mtp else "model"
    return [f"{owner}.layers.{layer}.{shards[s]}.{kind}" for s in sorted(shards) if (param, s) not in filled]


def named_tensors_to(
    tensors: Iterable[tuple[str, CheckpointTensor]], dtype: torch.dtype, device: torch.device | None = None
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Cast a stream of named float tensors to the compute dtype (quantized ones pass as they are). With
    `device`, every tensor moves there first: GGUF-held layers keep the tensors they are given."""
    for name, tensor in tensors:
        if device is not None and isinstance(tensor, GroupedQuant | torch.Tensor):
            tensor = tensor.to(device)
        yield name, tensor if isinstance(tensor, QuantizedWeight | GroupedQuant) else tensor.to(dtype)
