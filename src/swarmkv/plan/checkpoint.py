"""Read a model's files for the planner: its KV shape, its ModelConfig when swarmkv can build the model,
what weight format "auto" means for it, and the weight files' size (a GGUF's tensors one by one:
plan/gguf_checkpoint.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from swarmkv.config import ModelConfig
from swarmkv.errors import ModelLoadError, UnsupportedModelError
from swarmkv.plan.reserve import ReserveDims
from swarmkv.plan.shape import KVShape, shape_from_hf_dict
from swarmkv.plan.weights import Precision, ResolvedFormat

if TYPE_CHECKING:  # the gguf package loads only for GGUF files
    from swarmkv.plan.gguf_count import GGUFWeightCount


@dataclass(frozen=True)
class Checkpoint:
    """The model as the planner sees it, read from its files or built from flags, "auto" formats resolved."""

    shape: KVShape
    precision: Precision
    config: ModelConfig | None  # None when the weights cannot be counted: config_problem says why
    config_problem: str | None
    file_bytes: int | None  # the weight files' size; None when there are none
    gguf_weights: GGUFWeightCount | None = None  # a GGUF's tensors as held, when planned at its own format
    dims: ReserveDims | None = None  # the reserve's dimensions when there is no config (a GGUF's metadata)


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


def _gguf_checkpoint(
    path: Path, kv_dtype: str, state_dtype: str | None, weight_format: str, mtp: bool
) -> Checkpoint:
    from swarmkv.plan.gguf_checkpoint import read_gguf  # the gguf package: only for GGUF files

    read = read_gguf(path, kv_dtype, state_dtype, weight_format, mtp)
    return Checkpoint(
        read.shape, read.precision, read.config, read.config_problem, read.file_bytes, read.weights, read.dims
    )


def load_checkpoint(
    model: str | Path,
    kv_dtype: str = "auto",
    state_dtype: str | None = None,
    weight_format: str = "auto",
    mtp: bool = False,
) -> Checkpoint:
    """Read an HF directory, a config.json or a GGUF file; "auto" resolves against the files. `mtp`: a GGUF's
    multi-token-prediction layer is held (and keeps KV) as the engine holds it to draft."""
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"no config.json in {path}")
        return _hf_checkpoint(path / "config.json", kv_dtype, state_dtype, weight_format)
    if not path.is_file():
        raise ModelLoadError(f"model not found: {path}")
    if path.suffix == ".json":
        return _hf_checkpoint(path, kv_dtype, state_dtype, weight_format)
    return _gguf_checkpoint(path, kv_dtype, state_dtype, weight_format, mtp)
