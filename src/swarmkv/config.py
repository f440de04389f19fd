"""ModelConfig: one frozen description of a decoder, normalised from HF config.json or GGUF metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from swarmkv.errors import ModelLoadError, UnsupportedModelError

Architecture = Literal["llama", "qwen2", "qwen3"]

# HF `architectures` entries and GGUF `general.architecture` values we run, mapped to our family names.
HF_ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
GGUF_ARCHITECTURES: dict[str, Architecture] = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
FULL_ATTENTION = "full_attention"
KV_LAYER_TYPES = frozenset({FULL_ATTENTION, "sliding_attention"})  # layer kinds that keep a KV cache

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: "linear" divides positions, "llama3" reshapes the spectrum."""

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code and the KV pool need to know about a checkpoint's shape."""

    architecture: Architecture
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False
    attention_bias: bool = False
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.num_heads} attention heads is not a multiple of {self.num_kv_heads} KV heads"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ModelLoadError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )

    @property
    def num_attention_layers(self) -> int:
        """Layers that keep a KV cache (all of them unless layer_types says otherwise)."""
        if self.layer_types is None:
            return self.num_layers
        return sum(t in KV_LAYER_TYPES for t in self.layer_types)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all attention layers."""
        element_bytes = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_attention_layers * self.num_kv_heads * self.head_dim * element_bytes

    def require_runnable(self) -> None:
        """Refuse layer kinds the model code would otherwise run wrongly."""
        for kind in sorted(set(self.layer_types or ())):
            if kind != FULL_ATTENTION:
                raise UnsupportedModelError(
                    f"unsupported layer type {kind!r}: swarmkv runs full-attention layers only"
                )

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Normalise a Hugging Face config.json dict."""
        names = raw.get("architectures") or []
        arch = next((HF_ARCHITECTURES[n] for n in names if n in HF_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {names or raw.get('model_type')!r}; "
                f"supported: {', '.join(sorted(HF_ARCHITECTURES))}"
            )
        text = raw.get("text_config") or raw
        try:
            layers = int(text["num_hidden_layers"])
            heads = int(text["num_attention_heads"])
            hidden = int(text["hidden_size"])
            layer_types = text.get("layer_types")
            sliding = text.get("sliding_window")
            uses_sliding = text.get("use_sliding_window", arch == "llama")
            if sliding is not None and uses_sliding and layer_types is None:
                layer_types = ["sliding_attention"] * layers
            rope = text.get("rope_parameters") or {}
            scaling_raw = text.get("rope_scaling") or (
                rope if rope.get("rope_type", "default") != "default" else None
            )
            return cls(
                architecture=arch,
                num_layers=layers,
                hidden_size=hidden,
                num_heads=heads,
                num_kv_heads=int(text.get("num_key_value_heads") or heads),
                head_dim=int(text.get("head_dim") or hidden // heads),
                intermediate_size=int(text["intermediate_size"]),
                vocab_size=int(text["vocab_size"]),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                rope_theta=float(text.get("rope_theta") or rope.get("rope_theta", 10000.0)),
                max_position_embeddings=int(text.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(
                    raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
                ),
                rope_scaling=_rope_scaling(scaling_raw),
                qk_norm=arch == "qwen3",
                attention_bias=arch == "qwen2" or bool(text.get("attention_bias", False)),
                layer_types=tuple(layer_types) if layer_types is not None else None,
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks required field {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json has a field of the wrong type: {exc}") from exc

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` from a Hugging Face checkpoint directory."""
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"no config.json in {path}")
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{config_path} is not valid JSON: {exc}") from exc
        return cls.from_hf_dict(raw)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], num_output_tensors: int = 0) -> ModelConfig:
        """Normalise GGUF metadata; `num_output_tensors` is 0 when the LM head is tied to the embedding."""
        name = str(meta.get("general.architecture", ""))
        if name not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {name!r}; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
            )
        arch = GGUF_ARCHITECTURES[name]

        def get(key: str, default: Any = None) -> Any:
            value = meta.get(f"{name}.{key}", default)
            if value is None:
                raise ModelLoadError(f"GGUF metadata lacks {name}.{key}")
            return value

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        kv_heads = get("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            raise UnsupportedModelError("per-layer KV head counts are not supported")
        vocab = meta.get(f"{name}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
        scaling_type = meta.get(f"{name}.rope.scaling.type")
        scaling = None
        if scaling_type not in (None, "none"):
            scaling = _rope_scaling(
                {
                    "rope_type": scaling_type,
                    "factor": meta.get(f"{name}.rope.scaling.factor", 1.0),
                    "original_max_position_embeddings": meta.get(
                        f"{name}.rope.scaling.original_context_length", 8192
                    ),
                }
            )
        sliding = meta.get(f"{name}.attention.sliding_window")
        return cls(
            architecture=arch,
            num_layers=int(get("block_count")),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=int(meta.get(f"{name}.attention.key_length") or hidden // heads),
            intermediate_size=int(get("feed_forward_length")),
            vocab_size=int(vocab),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings=num_output_tensors == 0,
            rope_scaling=scaling,
            qk_norm=arch == "qwen3",
            attention_bias=arch == "qwen2",
            layer_types=("sliding_attention",) * int(get("block_count")) if sliding else None,
        )


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
    if not raw:
        return None
    kind = raw.get("rope_type") or raw.get("type")
    if kind in (None, "default"):
        return None
    if kind not in ("linear", "llama3"):
        raise UnsupportedModelError(f"unsupported rope scaling {kind!r}; supported: linear, llama3")
    return RopeScaling(
        kind=kind,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Turn "auto" or a dtype name into a torch dtype valid on `device`."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]
