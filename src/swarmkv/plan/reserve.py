"""The GPU memory an engine needs besides its weights and KV pages, part by part, every constant stated."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from swarmkv.config import ModelConfig

# A layer's input, its outputs and the MLP's intermediate products are alive together: the MLP's peak is
# about 2 x hidden + 4 x intermediate per token (residual, input, gate-up, silu(gate), its product with
# up), which the one-pass widths below (hidden + qkv + gate-up) cover with margin when doubled.
ACTIVATION_FACTOR = 2
LOGITS_BYTES_PER_ELEMENT = 4  # the sampled rows' logits are float32
ROTARY_BYTES_PER_ELEMENT = 4  # the cos and sin tables are float32
# The CUDA context, cuBLAS and Triton workspaces and the CUDA-graph memory pool: a fixed allowance.
DEFAULT_WORKSPACE = "512MiB"


@dataclass(frozen=True)
class RuntimeReserve:
    """Activations of the largest prefill chunk, one step's sampled logits, the rotary table, a workspace."""

    max_num_batched_tokens: int
    activation_width: int  # hidden + (q + 2 kv) + 2 x intermediate: one token's widths through a layer
    activation_element_bytes: int
    vocab_size: int
    max_num_seqs: int  # rows sampled in one step, at most
    rotary_positions: int
    head_dim: int
    workspace_bytes: int

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")

    @property
    def activation_bytes(self) -> int:
        """max_num_batched_tokens x activation_width x element bytes x ACTIVATION_FACTOR."""
        return (
            self.max_num_batched_tokens
            * self.activation_width
            * self.activation_element_bytes
            * ACTIVATION_FACTOR
        )

    @property
    def logits_bytes(self) -> int:
        """vocab x max_num_seqs x 4 bytes."""
        return self.vocab_size * self.max_num_seqs * LOGITS_BYTES_PER_ELEMENT

    @property
    def rotary_bytes(self) -> int:
        """2 (cos, sin) x positions x head dim x 4 bytes, built once for every position the model allows."""
        return 2 * self.rotary_positions * self.head_dim * ROTARY_BYTES_PER_ELEMENT

    @property
    def total_bytes(self) -> int:
        """The whole reserve."""
        return self.activation_bytes + self.logits_bytes + self.rotary_bytes + self.workspace_bytes

    def to_json(self) -> dict[str, Any]:
        """The reserve as the `--json` output writes it."""
        parts = {
            "activation_bytes": self.activation_bytes,
            "activation_factor": ACTIVATION_FACTOR,
            "logits_bytes": self.logits_bytes,
            "rotary_bytes": self.rotary_bytes,
        }
        return {**asdict(self), **parts, "total_bytes": self.total_bytes}


@dataclass(frozen=True)
class ReserveDims:
    """The model dimensions the reserve depends on, from a ModelConfig or from a GGUF file's metadata."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int

    @classmethod
    def from_config(cls, config: ModelConfig) -> ReserveDims:
        """The dimensions of a ModelConfig."""
        return cls(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            config.vocab_size,
            config.max_position_embeddings,
        )


def runtime_reserve(
    model: ModelConfig | ReserveDims,
    element_bytes: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    workspace_bytes: int,
) -> RuntimeReserve:
    """The reserve of an engine running `model` with activations of `element_bytes` each."""
    dims = model if isinstance(model, ReserveDims) else ReserveDims.from_config(model)
    q_size, kv_size = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
    return RuntimeReserve(
        max_num_batched_tokens=max_num_batched_tokens,
        activation_width=dims.hidden_size + q_size + 2 * kv_size + 2 * dims.intermediate_size,
        activation_element_bytes=element_bytes,
        vocab_size=dims.vocab_size,
        max_num_seqs=max_num_seqs,
        rotary_positions=dims.max_position_embeddings,
        head_dim=dims.head_dim,
        workspace_bytes=workspace_bytes,
    )
