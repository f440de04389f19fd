"""The shape the planner works from: KV-holding layers x KV heads x head dim, plus any recurrent state."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from swarmkv.config import DTYPES
from swarmkv.errors import ModelLoadError, UnsupportedModelError
from swarmkv.kv.state_index import MIN_SNAPSHOT_TOKENS

# The engine's kv_cache_dtype names (swarmkv.engine.kv_cache.KV_CACHE_DTYPES, less "auto"): fp8 is one byte.
KV_DTYPES: dict[str, torch.dtype] = {**DTYPES, "fp8_e4m3": torch.float8_e4m3fn}
KV_LAYER_KINDS = ("full_attention", "sliding_attention")
LINEAR_ATTENTION = "linear_attention"


def element_bytes(dtype: str) -> int:
    """Bytes per element of a KV dtype name; ValueError on a name we do not know."""
    if dtype not in KV_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(KV_DTYPES)}")
    return KV_DTYPES[dtype].itemsize


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value}")


@dataclass(frozen=True)
class RecurrentState:
    """The constant per-sequence state of Gated DeltaNet ("linear_attention") layers.

    Layout as swarmkv's engine keeps it (swarmkv.engine.state_cache.StateCache) and vLLM allocates it
    (MambaStateShapeCalculator.gated_delta_net_state_shape), per layer and per sequence:
      conv window: (conv_kernel - 1) x conv_dim, conv_dim = 2 x key_heads x key_dim + value_heads x value_dim
        (the causal conv1d over the concatenated q, k, v keeps its last kernel - 1 inputs), at `conv_dtype`;
      matrices: value_heads x key_dim x value_dim (one key_dim x value_dim matrix per value head), at
        `ssm_dtype`.
    `state_dtypes` gives the engine's dtypes: the window at the model's dtype, the matrices at least float32.
    """

    num_layers: int
    conv_kernel: int
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_dtype: str
    ssm_dtype: str

    def __post_init__(self) -> None:
        _require_positive(
            **{f.name: getattr(self, f.name) for f in fields(self) if not f.name.endswith("dtype")}
        )
        element_bytes(self.conv_dtype)
        element_bytes(self.ssm_dtype)

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v side by side."""
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim

    @property
    def conv_elements_per_layer(self) -> int:
        """Elements of one layer's conv state for one sequence."""
        return (self.conv_kernel - 1) * self.conv_dim

    @property
    def ssm_elements_per_layer(self) -> int:
        """Elements of one layer's recurrent (SSM) state for one sequence."""
        return self.num_value_heads * self.key_head_dim * self.value_head_dim

    @property
    def bytes_per_sequence(self) -> int:
        """Bytes of state one sequence holds across all linear-attention layers, whatever its length."""
        conv = self.conv_elements_per_layer * element_bytes(self.conv_dtype)
        return self.num_layers * (conv + self.ssm_elements_per_layer * element_bytes(self.ssm_dtype))


def state_dtypes(model_dtype: str, override: str | None = None) -> tuple[str, str]:
    """(conv window, matrices) dtypes of a hybrid's state. The engine keeps the window at the model's dtype
    and the matrices at promote(model dtype, float32), as they accumulate over the whole context; an
    `override` (--state-dtype) puts both at one dtype, as vLLM's default mamba_ssm_cache_dtype does."""
    if override is not None:
        return override, override
    if model_dtype not in DTYPES:
        raise ValueError(f"the model's dtype must be one of {', '.join(DTYPES)}, got {model_dtype!r}")
    wide = torch.promote_types(DTYPES[model_dtype], torch.float32)
    return model_dtype, next(name for name, dtype in DTYPES.items() if dtype == wide)


@dataclass(frozen=True)
class KVShape:
    """What one token costs in KV: K and V for every KV-holding layer, at one dtype."""

    num_layers: int
    num_kv_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    recurrent: RecurrentState | None = None
    num_sliding_layers: int = 0

    def __post_init__(self) -> None:
        _require_positive(
            layers=self.num_layers,
            kv_layers=self.num_kv_layers,
            kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )
        element_bytes(self.dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) x KV layers x KV heads x head dim x element bytes."""
        return 2 * self.num_kv_layers * self.num_kv_heads * self.head_dim * element_bytes(self.dtype)

    @property
    def state_bytes_per_sequence(self) -> int:
        """Recurrent state every sequence holds regardless of length (0 for a pure transformer)."""
        return self.recurrent.bytes_per_sequence if self.recurrent else 0

    def shares_prefix(self, prefix_tokens: int) -> bool:
        """Whether agents resuming after a common prefix of this length share its KV. A hybrid resumes only
        from a state snapshot, and the engine snapshots no prefix shorter than MIN_SNAPSHOT_TOKENS."""
        return self.recurrent is None or prefix_tokens >= MIN_SNAPSHOT_TOKENS


def _int(table: dict[str, Any], key: str, fallback: Any = None) -> int:
    value = table.get(key) if table.get(key) is not None else fallback
    if value is None:
        raise ModelLoadError(f"config lacks required field {key!r}")
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"config field {key!r} is not an integer: {value!r}") from exc


def shape_from_hf_dict(
    raw: dict[str, Any], dtype: str, state_dtype: str | None = None, model_dtype: str | None = None
) -> KVShape:
    """KV shape of a Hugging Face config.json (text_config nested or not, hybrid or not): KV at `dtype`,
    a hybrid's state as the engine keeps it for a model computing at `model_dtype` (default `dtype`)
    unless `state_dtype` overrides it."""
    text = raw.get("text_config") or raw
    layers = _int(text, "num_hidden_layers")
    heads = _int(text, "num_attention_heads")
    if layers <= 0 or heads <= 0:
        raise ModelLoadError(f"config has {layers} layers and {heads} attention heads; both must be positive")
    has_head_dim = text.get("head_dim") is not None
    head_dim = _int(text, "head_dim") if has_head_dim else _int(text, "hidden_size") // heads
    kinds = text.get("layer_types")
    if kinds is None and "full_attention_interval" in text and "linear_num_value_heads" in text:
        # Qwen3-Next configs may omit layer_types: every interval-th layer is full attention.
        interval = _int(text, "full_attention_interval")
        kinds = [LINEAR_ATTENTION if (i + 1) % interval else "full_attention" for i in range(layers)]
    kinds = list(kinds) if kinds is not None else ["full_attention"] * layers
    if len(kinds) != layers:
        raise ModelLoadError(f"layer_types has {len(kinds)} entries for {layers} layers")
    unknown = sorted(set(kinds) - {*KV_LAYER_KINDS, LINEAR_ATTENTION})
    if unknown:
        raise UnsupportedModelError(
            f"the planner does not know layer type(s) {', '.join(map(repr, unknown))}"
        )
    num_linear = kinds.count(LINEAR_ATTENTION)
    recurrent = None
    if num_linear:
        conv_dtype, ssm_dtype = state_dtypes(model_dtype or dtype, state_dtype)
        recurrent = RecurrentState(
            num_layers=num_linear,
            conv_kernel=_int(text, "linear_conv_kernel_dim"),
            num_key_heads=_int(text, "linear_num_key_heads"),
            num_value_heads=_int(text, "linear_num_value_heads"),
            key_head_dim=_int(text, "linear_key_head_dim"),
            value_head_dim=_int(text, "linear_value_head_dim"),
            conv_dtype=conv_dtype,
            ssm_dtype=ssm_dtype,
        )
    return KVShape(
        num_layers=layers,
        num_kv_layers=layers - num_linear,
        num_kv_heads=_int(text, "num_key_value_heads", heads),
        head_dim=head_dim,
        dtype=dtype,
        recurrent=recurrent,
        num_sliding_layers=kinds.count("sliding_attention"),
    )
