"""A GGUF file as the planner sees it, from its metadata and tensor infos alone: the KV shape (a hybrid's
recurrent state included), the dimensions of the runtime reserve, and every tensor's bytes as swarmkv holds it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from swarmkv.config import ModelConfig
from swarmkv.errors import ModelLoadError, UnsupportedModelError
from swarmkv.models.gguf_held import nextn_first_block
from swarmkv.plan.gguf_count import EMBEDDING, LM_HEAD, GGUFWeightCount, count_gguf_weights
from swarmkv.plan.reserve import ReserveDims
from swarmkv.plan.shape import KVShape, RecurrentState, state_dtypes
from swarmkv.plan.weights import Precision

_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)")
# llama.cpp's Gated DeltaNet keys (qwen35, qwen3next): conv taps, key head dim, key heads, value heads, v width.
_SSM_KEYS = ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size")


@dataclass(frozen=True)
class GGUFPlan:
    """What the planner reads from a GGUF file."""

    shape: KVShape
    precision: Precision
    config: ModelConfig | None
    config_problem: str | None
    file_bytes: int  # every tensor's bytes in the file
    weights: GGUFWeightCount | None  # None unless the weight format is the file's own ("auto")
    dims: ReserveDims


class _Meta:
    """`{arch}.key` lookups of a GGUF file's metadata, naming the file in what they raise."""

    def __init__(self, path: Path, metadata: Mapping[str, Any], arch: str) -> None:
        self.path, self.metadata, self.arch = path, metadata, arch

    def get(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(f"{self.arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {self.arch}.{key}")
        return value

    def has(self, key: str) -> bool:
        return self.metadata.get(f"{self.arch}.{key}") is not None


def _uniform(meta: _Meta, key: str, layers: list[int], default: Any = None) -> int:
    """A per-model count that llama.cpp may write per layer: one value across `layers` (0 entries skipped)."""
    value = meta.get(key, default)
    if not isinstance(value, list):
        return int(value)
    values = {int(value[i]) for i in layers if i < len(value) and int(value[i])}
    if len(values) != 1:
        raise UnsupportedModelError(
            f"{meta.path}: {meta.arch}.{key} differs across layers ({sorted(values)})"
        )
    return values.pop()


def _recurrent_state(meta: _Meta, num_linear: int, dtype: str, state_dtype: str | None) -> RecurrentState:
    missing = [key for key in _SSM_KEYS if not meta.has(key)]
    if missing:
        raise UnsupportedModelError(
            f"{meta.path}: recurrent ({meta.arch}) layers without Gated DeltaNet's metadata"
            f" ({', '.join(f'{meta.arch}.{k}' for k in missing)}) are not planned"
        )
    value_heads = int(meta.get("ssm.time_step_rank"))
    conv_dtype, ssm_dtype = state_dtypes(dtype, state_dtype)
    return RecurrentState(
        num_layers=num_linear,
        conv_kernel=int(meta.get("ssm.conv_kernel")),
        num_key_heads=int(meta.get("ssm.group_count")),
        num_value_heads=value_heads,
        key_head_dim=int(meta.get("ssm.state_size")),
        value_head_dim=int(meta.get("ssm.inner_size")) // value_heads,
        conv_dtype=conv_dtype,
        ssm_dtype=ssm_dtype,
    )


def read_gguf(
    path: Path, kv_dtype: str, state_dtype: str | None, weight_format: str, mtp: bool = False
) -> GGUFPlan:
    """Plan from a GGUF file's header: no tensor data is read. `mtp`: the multi-token-prediction layers after
    the decoder's are held, each with a KV slab, as the engine holds them to draft."""
    from swarmkv.models.gguf_file import open_gguf  # the gguf package: only for GGUF files

    gguf_file = open_gguf(path)
    meta = _Meta(path, gguf_file.metadata, gguf_file.architecture)
    tensors = {t.name: t for t in gguf_file.reader.tensors}
    # Floats and every quantized tensor's scales are held at float16 (bfloat16 on the GPU: the same bytes).
    precision = Precision.resolve(weight_format, "float16")
    blocks = int(meta.get("block_count"))
    first_skipped = nextn_first_block(gguf_file.metadata, meta.arch)
    layers = blocks if first_skipped is None else first_skipped
    linear = sorted(
        {
            int(m.group(1))
            for name in tensors
            if (m := _BLOCK.match(name)) and m.group(2).startswith("ssm_") and int(m.group(1)) < layers
        }
    )
    attention = [i for i in range(layers) if i not in set(linear)]
    if not attention:
        raise UnsupportedModelError(f"{path}: no attention layers; the planner needs at least one")
    heads = _uniform(meta, "attention.head_count", attention)
    kv_heads = _uniform(meta, "attention.head_count_kv", attention, heads)
    hidden = int(meta.get("embedding_length"))
    key_dim = int(meta.get("attention.key_length", hidden // heads))
    if int(meta.get("attention.value_length", key_dim)) != key_dim:
        raise UnsupportedModelError(
            f"{path}: key and value head sizes differ; the planner assumes one head dim"
        )
    recurrent = None
    if linear:
        recurrent = _recurrent_state(meta, len(linear), precision.dtype, state_dtype)
    mtp_layers = blocks - layers if mtp else 0
    shape = KVShape(
        num_layers=layers,
        num_kv_layers=len(attention) + mtp_layers,
        num_kv_heads=kv_heads,
        head_dim=key_dim,
        dtype=precision.kv_dtype(kv_dtype),
        recurrent=recurrent,
    )
    config, problem = None, None
    try:
        config = ModelConfig.from_gguf_metadata(
            gguf_file.metadata, num_output_tensors=int(LM_HEAD in tensors)
        )
    except (ModelLoadError, UnsupportedModelError) as exc:
        problem = str(exc)
    embedding = tensors.get(EMBEDDING)
    vocab = int(embedding.shape[1]) if embedding is not None and len(embedding.shape) > 1 else 0
    if config is not None and not config.vocab_size and vocab:
        config = replace(config, vocab_size=vocab)  # a file without its tokenizer: the embedding's rows
    dims = ReserveDims(
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=key_dim,
        intermediate_size=_uniform(meta, "feed_forward_length", attention),
        vocab_size=vocab
        or int(meta.get("vocab_size", len(gguf_file.metadata.get("tokenizer.ggml.tokens") or []))),
        max_position_embeddings=int(meta.get("context_length", 2048)),
    )
    weights = None
    if weight_format == "auto":
        weights = count_gguf_weights(gguf_file.reader, gguf_file.metadata, precision.torch_dtype, mtp)
    file_bytes = sum(int(t.n_bytes) for t in gguf_file.reader.tensors)
    return GGUFPlan(shape, precision, config, problem, file_bytes, weights, dims)
