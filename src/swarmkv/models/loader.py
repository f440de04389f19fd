"""Open a checkpoint (Hugging Face directory or GGUF file) into a config, a model and a tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open

import swarmkv.resolve as resolve
from swarmkv.choices import WeightsOption
from swarmkv.config import ModelConfig, resolve_dtype
from swarmkv.errors import ConfigError, ModelLoadError
from swarmkv.kernels.huge_pages import pack_tensors
from swarmkv.models.decoder import DecoderForCausalLM
from swarmkv.models.default import default_model_path
from swarmkv.models.quantized import WeightFormat, finalize_quantized
from swarmkv.models.registry import build_model
from swarmkv.models.weights import load_weights, named_tensors_to
from swarmkv.tokenizer import Tokenizer

if TYPE_CHECKING:
    from swarmkv.models.gguf_file import GGUFFile
    from swarmkv.models.gguf_weights import WeightReport


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to run: its normalised config, weights on a device, and tokenizer."""

    path: Path
    name: str
    config: ModelConfig
    model: DecoderForCausalLM
    tokenizer: Tokenizer
    dtype: torch.dtype
    device: torch.device
    weights: WeightFormat = "float"  # the format of the layers' projections
    weight_report: WeightReport | None = None  # a GGUF file's tensors per type, as held ("gguf" format)


def resolve_model_path(path: str | Path | None) -> Path:
    """The checkpoint to load: `path` when given (must exist), else the embedded default model."""
    if path is None:
        return default_model_path()
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise ModelLoadError(f"model path does not exist: {resolved}")
    return resolved


def checkpoint_file_or_dir(path: str | Path | None) -> Path:
    """The checkpoint `path` names: an HF directory with config.json, or a GGUF file (a folder without
    config.json: its first .gguf); the embedded default model when None."""
    resolved = resolve_model_path(path)
    if resolved.is_dir() and not (resolved / "config.json").is_file():
        ggufs = sorted(resolved.glob("*.gguf"))
        if not ggufs:
            raise ModelLoadError(
                f"no model in {resolved}: expected config.json with *.safetensors weights, or a .gguf file"
            )
        resolved = ggufs[0]
    return resolved


def load_model(
    path: str | Path | None = None,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    weights: WeightsOption = "auto",
    mtp: bool = False,
) -> LoadedModel:
    """Load a Hugging Face directory or a GGUF file (the default model when `path` is None), its projections
    in `weights`: auto keeps a GGUF's every tensor at its own bits; safetensors stay float unless int8 or int4
    is asked for. `mtp`: also hold the checkpoint's multi-token-prediction layer, if it has one (a drafter)."""
    resolved = checkpoint_file_or_dir(path)
    device = torch.device(device)
    compute_dtype = resolve_dtype(dtype, device)
    if resolved.is_file():
        from swarmkv.models.gguf_file import open_gguf  # the gguf package: only for GGUF files

        return _load_gguf(open_gguf(resolved), compute_dtype, device, weights, mtp)
    if weights == "gguf":
        raise ConfigError(
            f"--weights gguf keeps a GGUF file's own blocks; {resolved} is a safetensors checkpoint"
        )
    return _load_hf_dir(resolved, compute_dtype, device, resolve.weight_format(weights, "safetensors"), mtp)


def instantiate_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, weights: WeightFormat = "float"
) -> DecoderForCausalLM:
    """A model of `config`'s shape on `device` with uninitialised weights (a loader or a benchmark fills them)."""
    # Built on the meta device so no time is spent on random initialisation that the weights overwrite.
    with torch.device("meta"):
        model = build_model(config, weights)
    # Cast while still on meta: casting allocated-but-uninitialised memory costs seconds for bfloat16.
    model.to(dtype).to_empty(device=device)
    model.rotary.build(device)
    return model


def _load_gguf(
    file: GGUFFile, dtype: torch.dtype, device: torch.device, weights: WeightsOption, mtp: bool
) -> LoadedModel:
    from swarmkv.models.gguf_weights import Keep, WeightReport, checkpoint_kind, gguf_tensors

    names = {t.name for t in file.reader.tensors}
    config = ModelConfig.from_gguf_metadata(file.metadata, num_output_tensors=int("output.weight" in names))
    config = config.with_mtp() if mtp else config
    config.require_runnable()
    fmt = resolve.weight_format(weights, checkpoint_kind(file))
    _require_grouped_kernels(fmt, device)
    model = instantiate_model(config, dtype, device, fmt)
    report = WeightReport() if fmt == "gguf" else None
    keep: Keep = "gguf" if fmt == "gguf" else "int4" if fmt == "int4" else "float"
    tensors = gguf_tensors(file, config, keep=keep, dtype=dtype, report=report)
    load_weights(model, config, named_tensors_to(tensors, _load_dtype(fmt, dtype), _load_device(fmt, device)))
    finalize_quantized(model)
    model.tie_weights()
    if fmt == "gguf":
        model.embed_tokens.finalize(dtype)  # type: ignore[operator]
    _pack_on_cpu(model, device)
    tokenizer = Tokenizer.from_gguf_metadata(file.metadata)
    name = str(file.metadata.get("general.name") or file.path.stem)
    return LoadedModel(file.path, name, config, model.eval(), tokenizer, dtype, device, fmt, report)


def _pack_on_cpu(model: DecoderForCausalLM, device: torch.device) -> None:
    """A CPU model's weights into one huge-page mapping (kernels/huge_pages.py): a decode step reads them all."""
    if device.type == "cpu":
        pack_tensors([*model.parameters(), *model.buffers()])


def _require_grouped_kernels(fmt: WeightFormat, device: torch.device) -> None:
    """ConfigError, before any weight is read, where the grouped layout's kernels ("gguf", "int8") do not run."""
    from swarmkv.models.gguf_linear import gguf_kernels_run_on

    if fmt in ("gguf", "int8") and not gguf_kernels_run_on(device):
        raise ConfigError(
            f"--weights {fmt} runs on the CPU, or on a CUDA or ROCm GPU with triton installed (pip install"
            f" triton), not on {device.type!r} here; elsewhere use --weights float"
        )


def _load_dtype(fmt: WeightFormat, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensors are read in: int8 layers quantize from float32 (the float parameters cast as they
    are copied), so the compute dtype's rounding is not added to the codes'."""
    return torch.float32 if fmt == "int8" else dtype


def _load_device(fmt: WeightFormat, device: torch.device) -> torch.device | None:
    """Where tensors move before they load: the device for a GGUF's blocks, which layers hold as given. Float
    tensors stay on the host: a parameter copies them over, and an int8 layer quantizes them there and moves
    only the codes (a float32 matrix and its quantization's temporaries would otherwise peak on the device)."""
    return device if fmt == "gguf" else None


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ModelLoadError(f"{index.name} names shards that are missing: {', '.join(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no weights in {path}: expected *.safetensors files or a .gguf file")
    return files


def _safetensors_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    yield name, handle.get_tensor(name)
        except SafetensorError as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from exc


def _load_hf_dir(
    path: Path, dtype: torch.dtype, device: torch.device, weights: WeightFormat, mtp: bool
) -> LoadedModel:
    config = ModelConfig.from_hf_dir(path)
    config = config.with_mtp() if mtp else config
    config.require_runnable()
    files = _safetensors_files(path)
    _require_grouped_kernels(weights, device)
    model = instantiate_model(config, dtype, device, weights)
    tensors = _safetensors_tensors(files)
    load_weights(
        model, config, named_tensors_to(tensors, _load_dtype(weights, dtype), _load_device(weights, device))
    )
    finalize_quantized(model)
    model.tie_weights()
    _pack_on_cpu(model, device)
    tokenizer = Tokenizer.from_hf_dir(path)
    return LoadedModel(path, path.name, config, model.eval(), tokenizer, dtype, device, weights)
