"""ModelConfig: one frozen description of a decoder, normalised from HF config.json or GGUF metadata."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

import swarmkv.resolve as resolve
from swarmkv.errors import ModelLoadError, UnsupportedModelError

Architecture = Literal["llama", "qwen2", "qwen3", "qwen3_5"]

# HF `architectures` entries and GGUF `general.architecture` values we run, mapped to our family names.
HF_ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # its text part: token ids in, no image inputs
}
# Relatives of the families above that name what they add, so the refusal says what is missing.
HF_UNSUPPORTED: dict[str, str] = {
    "Qwen3_5MoeForCausalLM": "Qwen3.5 MoE needs mixture-of-experts layers, which swarmkv does not run",
    "Qwen3_5MoeForConditionalGeneration": "Qwen3.5 MoE needs mixture-of-experts layers, which swarmkv does not run",
    "Qwen3NextForCausalLM": "Qwen3-Next needs mixture-of-experts layers, which swarmkv does not run",
}
GGUF_ARCHITECTURES: dict[str, Architecture] = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen35": "qwen3_5",
}
GGUF_UNSUPPORTED: dict[str, str] = {
    "qwen35moe": "Qwen3.5 MoE needs mixture-of-experts layers, which swarmkv does not run",
    "qwen3next": "Qwen3-Next needs mixture-of-experts layers, which swarmkv does not run",
}
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"  # Gated DeltaNet: a constant-size recurrent state instead of KV
KV_LAYER_TYPES = frozenset({FULL_ATTENTION, "sliding_attention"})  # layer kinds that keep a KV cache

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,  # for parity tests: greedy choices never hinge on rounding
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
class LinearAttentionShape:
    """Gated DeltaNet layers' shape: key heads serve value heads in groups; a causal conv runs over q, k, v."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # Value heads in llama.cpp's tiled order (value head j reads key head j % num_key_heads) rather than
    # Hugging Face's grouped one (j // (num_value_heads // num_key_heads)): its GGUF converter reorders them,
    # out_proj's input columns included, which a row-quantized weight cannot undo, so the model follows.
    value_heads_tiled: bool = False

    @property
    def key_dim(self) -> int:
        """Width of q (and of k) across heads."""
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        """Width of v (and of the output gate) across heads."""
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    def state_bytes(self, dtype: torch.dtype) -> int:
        """One layer's state for one sequence: the conv window in `dtype`, the recurrent matrix in at least
        float32 (the recurrence accumulates over the whole context)."""
        conv = self.conv_dim * (self.conv_kernel - 1) * _element_bytes(dtype)
        matrix = self.num_value_heads * self.key_head_dim * self.value_head_dim
        return conv + matrix * _element_bytes(torch.promote_types(dtype, torch.float32))


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
    linear: LinearAttentionShape | None = None  # hybrids: the linear-attention layers' shape
    partial_rotary_factor: float = 1.0  # rotary turns only the first head_dim x this dims
    attn_output_gate: bool = False  # q_proj also emits a per-head sigmoid gate on the attention output
    # Multi-token-prediction (MTP, "NextN") layers: how many the checkpoint has, and how many the model runs
    # as a drafter (0 unless `with_mtp`), each a full-attention layer whose KV slab follows the decoder's.
    checkpoint_mtp_layers: int = 0
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"{self.num_heads} attention heads is not a multiple of {self.num_kv_heads} KV heads"
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_layers:
            raise ModelLoadError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        if self.linear is not None and self.linear.num_value_heads % self.linear.num_key_heads:
            raise UnsupportedModelError(
                f"{self.linear.num_value_heads} linear-attention value heads is not a multiple of "
                f"{self.linear.num_key_heads} key heads"
            )

    @property
    def num_attention_layers(self) -> int:
        """Layers that keep a KV cache (all of them unless layer_types says otherwise), MTP layers included."""
        if self.layer_types is None:
            return self.num_layers + self.mtp_layers
        return sum(t in KV_LAYER_TYPES for t in self.layer_types) + self.mtp_layers

    @property
    def num_decoder_attention_layers(self) -> int:
        """The decoder's own attention layers: the first KV slabs (an MTP layer's slab comes after them)."""
        return self.num_attention_layers - self.mtp_layers

    def with_mtp(self) -> ModelConfig:
        """This config running the checkpoint's MTP layers (held, and given KV slabs)."""
        return dataclasses.replace(self, mtp_layers=self.checkpoint_mtp_layers)

    @property
    def num_linear_layers(self) -> int:
        """Linear-attention layers (each keeps a recurrent state per sequence instead of KV)."""
        return sum(t == LINEAR_ATTENTION for t in self.layer_types or ())

    @property
    def is_hybrid(self) -> bool:
        """Whether some layers keep a recurrent state: prefix hits then resume from state snapshots."""
        return self.num_linear_layers > 0

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that rotary turns (the rest pass through)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V one token occupies across all attention layers."""
        return 2 * self.num_attention_layers * self.num_kv_heads * self.head_dim * _element_bytes(dtype)

    def state_bytes_per_sequence(self, dtype: torch.dtype) -> int:
        """Bytes of recurrent state one sequence holds across the linear-attention layers (0 if none)."""
        if self.linear is None:
            return 0
        return self.num_linear_layers * self.linear.state_bytes(dtype)

    def require_runnable(self) -> None:
        """Refuse layer kinds the model code would otherwise run wrongly."""
        for kind in sorted(set(self.layer_types or ())):
            if kind == LINEAR_ATTENTION and self.linear is not None:
                continue
            if kind != FULL_ATTENTION:
                raise UnsupportedModelError(
                    f"unsupported layer type {kind!r} for architecture {self.architecture!r}: swarmkv runs "
                    f"full-attention layers, and linear-attention layers of Qwen3.5"
                )

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Normalise a Hugging Face config.json dict."""
        names = raw.get("architectures") or []
        for name in names:
            if name in HF_UNSUPPORTED:
                raise UnsupportedModelError(f"unsupported architecture {name!r}: {HF_UNSUPPORTED[name]}")
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
            if arch == "qwen3_5":
                return _qwen3_5(raw, text)
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
        if name in GGUF_UNSUPPORTED:
            raise UnsupportedModelError(f"unsupported GGUF architecture {name!r}: {GGUF_UNSUPPORTED[name]}")
        if name not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported GGUF architecture {name!r}; supported: {', '.join(sorted(GGUF_ARCHITECTURES))}"
            )
        arch = GGUF_ARCHITECTURES[name]
        if arch == "qwen3_5":
            return _qwen35_gguf(meta, tied=num_output_tensors == 0)

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


def _qwen3_5(raw: dict[str, Any], text: dict[str, Any]) -> ModelConfig:
    """Qwen3.5's text model: gated attention every `full_attention_interval`-th layer, Gated DeltaNet between."""
    if text.get("num_experts") or text.get("num_local_experts"):
        raise UnsupportedModelError(
            "this Qwen3.5 checkpoint has mixture-of-experts layers, which swarmkv does not run"
        )
    layers = int(text["num_hidden_layers"])
    layer_types = text.get("layer_types")
    if layer_types is None:
        interval = int(text.get("full_attention_interval", 4))
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
    rope = text.get("rope_parameters") or {}
    heads = int(text["num_attention_heads"])
    hidden = int(text["hidden_size"])
    return ModelConfig(
        architecture="qwen3_5",
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or hidden // heads),
        intermediate_size=int(text["intermediate_size"]),
        vocab_size=int(text["vocab_size"]),
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta") or text.get("rope_theta", 10000.0)),
        max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        rope_scaling=_rope_scaling(rope if rope.get("rope_type", "default") != "default" else None),
        qk_norm=True,
        attention_bias=bool(text.get("attention_bias", False)),
        layer_types=tuple(layer_types),
        linear=LinearAttentionShape(
            num_key_heads=int(text["linear_num_key_heads"]),
            num_value_heads=int(text["linear_num_value_heads"]),
            key_head_dim=int(text["linear_key_head_dim"]),
            value_head_dim=int(text["linear_value_head_dim"]),
            conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
        ),
        partial_rotary_factor=float(
            rope.get("partial_rotary_factor") or text.get("partial_rotary_factor", 0.25)
        ),
        attn_output_gate=bool(text.get("attn_output_gate", True)),
        checkpoint_mtp_layers=int(text.get("mtp_num_hidden_layers") or 0),
    )


def _qwen35_gguf(meta: dict[str, Any], tied: bool) -> ModelConfig:
    """llama.cpp's `qwen35` metadata (written by its converter from the HF config `_qwen3_5` reads)."""

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"qwen35.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks qwen35.{key}")
        return value

    # Multi-token-prediction layers (a speculative draft head) come after the decoder's own layers.
    mtp_layers = int(meta.get("qwen35.nextn_predict_layers") or 0)
    layers = int(get("block_count")) - mtp_layers
    recurrent = meta.get("qwen35.attention.recurrent_layers")
    if isinstance(recurrent, list):
        layer_types = [LINEAR_ATTENTION if r else FULL_ATTENTION for r in recurrent[:layers]]
    else:
        interval = int(get("full_attention_interval", 4))
        layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(layers)]
    heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    kv_heads = get("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UnsupportedModelError("per-layer KV head counts are not supported")
    head_dim = int(get("attention.key_length", hidden // heads))
    value_heads = int(get("ssm.time_step_rank"))
    vocab = meta.get("qwen35.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    return ModelConfig(
        architecture="qwen3_5",
        num_layers=layers,
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=head_dim,
        intermediate_size=int(get("feed_forward_length")),
        vocab_size=int(vocab),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", 32768)),
        tie_word_embeddings=tied,
        qk_norm=True,
        layer_types=tuple(layer_types),
        linear=LinearAttentionShape(
            num_key_heads=int(get("ssm.group_count")),
            num_value_heads=value_heads,
            key_head_dim=int(get("ssm.state_size")),
            value_head_dim=int(get("ssm.inner_size")) // value_heads,
            conv_kernel=int(get("ssm.conv_kernel", 4)),
            value_heads_tiled=True,
        ),
        # Text positions give all of Qwen3.5's rotary sections the same position: plain partial rotary.
        partial_rotary_factor=int(get("rope.dimension_count", head_dim // 4)) / head_dim,
        attn_output_gate=True,  # llama.cpp's qwen35 graph always splits attn_q into the query and its gate
        checkpoint_mtp_layers=mtp_layers,
    )


def _element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


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
    """A dtype name (auto resolved by `swarmkv.resolve.model_dtype`) as a torch dtype on `device`."""
    if isinstance(name, torch.dtype):
        return name
    return DTYPES[resolve.model_dtype(name, device.type)]
