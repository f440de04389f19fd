"""Read a model's files for the planner: its KV shape, its ModelConfig when swarmkv can build the model,
what weight format "auto" means for it, and the weight files' size."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from swarmkv.config import ModelConfig
from swarmkv.errors import ModelLoadError, UnsupportedModelError
from swarmkv.plan.shape import KVShape, shape_from_hf_dict
from swarmkv.plan.weights import Precision, ResolvedFormat


@dataclass(frozen=True)
class Checkpoint:
    """The model as the planner sees it, read from its files or built from flags, "auto" formats resolved."""

    shape: KVShape
    precision: Precision
    config: ModelConfig | None  # None when the weights cannot be counted: config_problem says why
    config_problem: str | None
    file_bytes: int | None  # the weight files' size; None when there are none


def _hf_auto_format(raw: dict[str, Any]) -> ResolvedFormat:
    """Float at the checkpoint's own dtype (float16 when its config does not say)."""
    text = raw.get("text_config") or raw
    name = raw.get("torch_dtype") or raw.get("dtype") or text.get("torch_dtype") or text.get("dtype")
    if name == "float32":
        return "float32"
    return "bfloat16" if name == "bfloat16" else "float16"


def _hf_checkpoint(
    config_path: Path, kv_dtype: str, state_dtype: str | None, weight_format: str
) -> Checkpoint:
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {config_path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_path} does not hold a JSON object")
    precision = Precision.resolve(weight_format, _hf_auto_format(raw))
    # The engine computes at the weights' float dtype, so a hybrid's state follows it, not the KV dtype.
    shape = shape_from_hf_dict(raw, precision.kv_dtype(kv_dtype), state_dtype, precision.dtype)
    config, problem = None, None
    try:
        config = ModelConfig.from_hf_dict(raw)
    except (ModelLoadError, UnsupportedModelError) as exc:
        problem = str(exc)
    shards = sorted(config_path.parent.glob("*.safetensors"))
    # Safetensors files are tensor bytes plus a small JSON header: close enough for a VRAM budget.
    file_bytes = sum(p.stat().st_size for p in shards) if shards else None
    return Checkpoint(shape, precision, config, problem, file_bytes)


def _gguf_checkpoint(path: Path, kv_dtype: str, weight_format: str) -> Checkpoint:
    from swarmkv.models.gguf_file import open_gguf  # the gguf package: only for GGUF files
    from swarmkv.models.gguf_weights import auto_weight_format

    gguf_file = open_gguf(path)
    meta, arch = gguf_file.metadata, gguf_file.architecture

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    heads = get("attention.head_count")
    kv_heads = get("attention.head_count_kv", heads)
    hybrid = any(k.startswith((f"{arch}.ssm.", f"{arch}.full_attention_interval")) for k in meta)
    if hybrid or isinstance(heads, list) or isinstance(kv_heads, list):
        raise UnsupportedModelError(
            f"{path}: per-layer or recurrent ({arch}) GGUF layouts are not planned from GGUF; "
            "pass the model's config.json instead"
        )
    key_dim = int(get("attention.key_length", int(get("embedding_length")) // int(heads)))
    if int(get("attention.value_length", key_dim)) != key_dim:
        raise UnsupportedModelError(
            f"{path}: key and value head sizes differ; the planner assumes one head dim"
        )
    # swarmkv keeps Q4_0/Q4_1 projections as int4 and requantizes other quants to int8 (the loader's
    # weights="auto"); float files load at the compute dtype, float16 here.
    own = auto_weight_format(gguf_file)
    precision = Precision.resolve(weight_format, "float16" if own == "float" else own)
    layers = int(get("block_count"))
    shape = KVShape(
        num_layers=layers,
        num_kv_layers=layers,
        num_kv_heads=int(kv_heads),
        head_dim=key_dim,
        dtype=precision.kv_dtype(kv_dtype),
    )
    names = {t.name for t in gguf_file.reader.tensors}
    config, problem = None, None
    try:
        config = ModelConfig.from_gguf_metadata(meta, num_output_tensors=int("output.weight" in names))
    except (ModelLoadError, UnsupportedModelError) as exc:
        problem = str(exc)
    file_bytes = sum(int(t.n_bytes) for t in gguf_file.reader.tensors)
    return Checkpoint(shape, precision, config, problem, file_bytes)


def load_checkpoint(
    model: str | Path, kv_dtype: str = "auto", state_dtype: str | None = None, weight_format: str = "auto"
) -> Checkpoint:
    """Read an HF directory, a config.json or a GGUF file; "auto" resolves against the files."""
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"no config.json in {path}")
        return _hf_checkpoint(path / "config.json", kv_dtype, state_dtype, weight_format)
    if not path.is_file():
        raise ModelLoadError(f"model not found: {path}")
    if path.suffix == ".json":
        return _hf_checkpoint(path, kv_dtype, state_dtype, weight_format)
    return _gguf_checkpoint(path, kv_dtype, weight_format)
