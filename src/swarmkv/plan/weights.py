"""What a model's weights occupy on the GPU, counted from its config at a weight format, and the check
against the same model built on the meta device."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import torch

import swarmkv.resolve as resolve
from swarmkv.choices import KVCacheDtype
from swarmkv.config import DTYPES, ModelConfig
from swarmkv.errors import UnsupportedModelError
from swarmkv.models.gguf_quants import INT8_GROUP_SIZE
from swarmkv.models.quantized import INT4_GROUP_SIZE, WeightFormat, linear_weight_bytes

if TYPE_CHECKING:  # the gguf package loads only for GGUF files
    from swarmkv.plan.gguf_count import GGUFWeightCount

ResolvedFormat = Literal["int4", "int8", "float16", "bfloat16", "float32"]
WEIGHT_FORMATS: tuple[str, ...] = ("auto", *get_args(ResolvedFormat))
# Quantized projections' scales, minimums and biases, and the float layers around them, are counted in
# float16: the GPU default of bfloat16 has the same 2 bytes.
QUANTIZED_COMPUTE_DTYPE = "float16"
AGREEMENT_FRACTION = 0.01  # --measure: the meta-built model's bytes must lie within 1% of the formula's


@dataclass(frozen=True)
class Precision:
    """A resolved weight format: int4 or int8 projections, or every weight in one float dtype."""

    weight_format: ResolvedFormat

    @classmethod
    def resolve(cls, option: str, auto: ResolvedFormat) -> Precision:
        """`option` as the flag gives it, "auto" meaning the checkpoint's own format `auto`."""
        if option not in WEIGHT_FORMATS:
            raise ValueError(f"unknown weight format {option!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
        return cls(cast(ResolvedFormat, resolve.planned_weight_format(option, auto)))

    @property
    def layer_format(self) -> WeightFormat:
        """The format of the layers' projections as the model code names it."""
        if self.weight_format == "int4":
            return "int4"
        return "int8" if self.weight_format == "int8" else "float"

    @property
    def dtype(self) -> str:
        """The float dtype of everything not quantized: embeddings, LM head, norms, biases, scales, activations."""
        return QUANTIZED_COMPUTE_DTYPE if self.layer_format != "float" else self.weight_format

    @property
    def torch_dtype(self) -> torch.dtype:
        """`dtype` as a torch dtype."""
        return DTYPES[self.dtype]

    def kv_dtype(self, option: str) -> str:
        """The KV dtype `option` names on a GPU (`swarmkv.resolve.kv_cache_dtype`: auto is this precision's float
        dtype; the CPU's C decode step, which halves a float32 model's pages, never runs there)."""
        return resolve.kv_cache_dtype(cast(KVCacheDtype, option), self.dtype)


@dataclass(frozen=True)
class WeightCount:
    """A model's weights in bytes, part by part, as swarmkv holds them on the GPU."""

    weight_format: ResolvedFormat
    dtype: str  # of embeddings, LM head, norms, biases, and the quantized projections' scales
    projections_bytes: int  # every layer's fused qkv (or a hybrid's fused in-projection), o, gate-up and down
    norms_bytes: int
    biases_bytes: int  # QKV biases, when the config has them
    embedding_bytes: int
    lm_head_bytes: int  # 0 when tied to the embedding
    tied_embeddings: bool
    recurrent_bytes: int = 0  # hybrids' linear attention: b | a projections, conv taps, decay, gated norms

    @property
    def total_bytes(self) -> int:
        """Everything the model's parameters and buffers hold."""
        return (
            self.projections_bytes
            + self.norms_bytes
            + self.biases_bytes
            + self.embedding_bytes
            + self.lm_head_bytes
            + self.recurrent_bytes
        )

    def to_json(self) -> dict[str, Any]:
        """The count as the `--json` output writes it."""
        return {**asdict(self), "total_bytes": self.total_bytes}


def projection_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """One attention layer's [out, in] projection weights: fused qkv (q twice over with an output gate), o,
    fused gate-up, down."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    q_rows = 2 * q_size if config.attn_output_gate else q_size
    return [(q_rows + 2 * kv_size, hidden), (hidden, q_size), (2 * inter, hidden), (hidden, inter)]


def linear_attention_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """One Gated DeltaNet layer's [out, in] projection weights in the weight format: fused in (q, k, v | z),
    out, fused gate-up, down. (Its b | a projection stays float: `linear_attention_float_elements`.)"""
    linear, hidden, inter = config.linear, config.hidden_size, config.intermediate_size
    assert linear is not None, "only a hybrid model has linear-attention layers"
    in_rows = linear.conv_dim + linear.value_dim
    return [(in_rows, hidden), (hidden, linear.value_dim), (2 * inter, hidden), (hidden, inter)]


def linear_attention_float_elements(config: ModelConfig) -> int:
    """One Gated DeltaNet layer's float elements besides its norms' weights: the b | a projection (float in
    every weight format), the conv's taps, dt_bias and A_log per value head, the gated norm's weight."""
    linear = config.linear
    assert linear is not None, "only a hybrid model has linear-attention layers"
    heads = linear.num_value_heads
    return (
        2 * heads * config.hidden_size
        + linear.conv_dim * linear.conv_kernel
        + 2 * heads
        + linear.value_head_dim
    )


def count_weights(config: ModelConfig, precision: Precision) -> WeightCount:
    """The weights of `config` at `precision`: projections through `linear_weight_bytes`, the rest in float."""
    fmt, dtype = precision.layer_format, precision.torch_dtype
    num_linear = config.num_linear_layers
    num_attention = config.num_layers - num_linear
    kinds = [(num_attention, projection_shapes(config))]
    if num_linear:
        kinds.append((num_linear, linear_attention_shapes(config)))
    group = {"int4": INT4_GROUP_SIZE, "int8": INT8_GROUP_SIZE}.get(fmt)
    if group is not None:
        odd = sorted({k for _, shapes in kinds for _, k in shapes if k % group})
        if odd:
            raise ValueError(
                f"{fmt} weights need input sizes divisible by {group}, got {', '.join(map(str, odd))}"
            )
    projections = sum(
        layers * sum(linear_weight_bytes(n, k, fmt, dtype) for n, k in shapes) for layers, shapes in kinds
    )
    element = dtype.itemsize
    qk_norms = 2 * config.head_dim if config.qk_norm else 0
    norm_elements = config.num_layers * 2 * config.hidden_size + num_attention * qk_norms + config.hidden_size
    recurrent_elements = num_linear * linear_attention_float_elements(config) if num_linear else 0
    qkv_out = projection_shapes(config)[0][0]
    embedding = config.vocab_size * config.hidden_size * element
    return WeightCount(
        weight_format=precision.weight_format,
        dtype=precision.dtype,
        projections_bytes=projections,
        norms_bytes=norm_elements * element,
        biases_bytes=num_attention * qkv_out * element if config.attention_bias else 0,
        embedding_bytes=embedding,
        lm_head_bytes=0 if config.tie_word_embeddings else embedding,
        tied_embeddings=config.tie_word_embeddings,
        recurrent_bytes=recurrent_elements * element,
    )


def meta_model_bytes(config: ModelConfig, precision: Precision) -> int:
    """Bytes of every parameter and buffer of the model swarmkv builds for `config`, on the meta device."""
    from swarmkv.models.loader import instantiate_model  # the loader's imports: only for --measure

    # Sliding attention changes the attention, not the weights, and the model code refuses to build it; the
    # linear-attention layers of a hybrid have weights of their own, and are built.
    try:
        config.require_runnable()
        buildable = config
    except UnsupportedModelError:
        buildable = replace(config, layer_types=None)
    model = instantiate_model(buildable, precision.torch_dtype, torch.device("meta"), precision.layer_format)
    if precision.layer_format == "int8":
        from swarmkv.models.gguf_linear import GGUFLinear
        from swarmkv.models.gguf_quants import int8_groups

        # int8 layers hold what loading gives them: an empty weight of each shape, quantized.
        for module in model.modules():
            if isinstance(module, GGUFLinear):
                empty = torch.empty(module.out_features, module.in_features, device="meta")
                module.load_block(0, int8_groups(empty))
    model.tie_weights()  # the loader ties after loading; tied, the head's matrix is the embedding's
    tensors = [*model.parameters(), *model.buffers()]  # parameters() lists a tied matrix once
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class WeightsCheck:
    """The formula's weights against the model built at that format on the meta device."""

    weight_format: ResolvedFormat
    formula_bytes: int
    measured_bytes: int

    @property
    def difference_bytes(self) -> int:
        """Measured minus formula."""
        return self.measured_bytes - self.formula_bytes

    @property
    def agrees(self) -> bool:
        """Within AGREEMENT_FRACTION of the formula's figure."""
        return abs(self.difference_bytes) <= AGREEMENT_FRACTION * self.formula_bytes

    def to_json(self) -> dict[str, Any]:
        """The check as the `--json` output writes it."""
        return {**asdict(self), "difference_bytes": self.difference_bytes, "agrees": self.agrees}


def check_weights(config: ModelConfig, precision: Precision) -> WeightsCheck:
    """Count the weights both ways."""
    return WeightsCheck(
        precision.weight_format,
        count_weights(config, precision).total_bytes,
        meta_model_bytes(config, precision),
    )


WeightsSource = Literal["config", "gguf", "files", "--weights"]


@dataclass(frozen=True)
class WeightsFigure:
    """The weights' bytes a VRAM budget uses, and where the figure came from."""

    num_bytes: int
    source: WeightsSource
    precision: Precision
    count: WeightCount | None  # the breakdown, when counted from the config
    file_bytes: int | None  # the weight files' size, when the model's files were read
    gguf: GGUFWeightCount | None = None  # a GGUF's tensors as held, when counted from the file

    def to_json(self) -> dict[str, Any]:
        """The fields the `fit` object of `--json` carries."""
        out: dict[str, Any] = {
            # A GGUF counted from its tensors keeps every tensor at its file's own type.
            "weight_format": "gguf" if self.gguf is not None else self.precision.weight_format,
            "weights_bytes": self.num_bytes,
            "weights_source": self.source,
        }
        if self.count is not None:
            out["weights"] = self.count.to_json()
        if self.gguf is not None:
            out["weights"] = self.gguf.to_json()
        if self.file_bytes is not None:
            out["weights_file_bytes"] = self.file_bytes
        return out
