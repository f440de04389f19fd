"""Refusals at load time: unsupported models raise UnsupportedModelError, damaged ones ModelLoadError."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file

from swarmkv.config import ModelConfig
from swarmkv.errors import ModelLoadError, UnsupportedModelError
from swarmkv.models.decoder import DecoderForCausalLM
from swarmkv.models.loader import load_model
from tiny_models import edit_config, make_tiny_checkpoint


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid tiny Qwen3 checkpoint; tests copy it before damaging it."""
    # A small embedding keeps the copies cheap; these tests never run the tokenizer's high ids.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pristine") / "qwen3", "qwen3", vocab_size=1024)


@pytest.fixture
def checkpoint(pristine: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny checkpoint, free to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "qwen3"))


def rewrite_weights(folder: Path, change: Any) -> None:
    """Apply `change` to the checkpoint's {name: tensor} dict and save it back."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def write_gguf(path: Path, architecture: str) -> Path:
    """A header-only GGUF file that declares `architecture`."""
    writer = gguf.GGUFWriter(path, architecture)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def qwen3_dict(**changes: Any) -> dict[str, Any]:
    """A minimal Qwen3 config.json dict."""
    raw = {
        "architectures": ["Qwen3ForCausalLM"],
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_size": 64,
        "intermediate_size": 128,
        "vocab_size": 1000,
    }
    return {**raw, **changes}


def test_the_pristine_checkpoint_loads(checkpoint: Path) -> None:
    """The damage in the tests below is what fails, not the checkpoint itself."""
    assert load_model(checkpoint, dtype="float32").config.architecture == "qwen3"


# ---- strict weight loading ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"],
)
def test_missing_tensor_is_named(checkpoint: Path, name: str) -> None:
    rewrite_weights(checkpoint, lambda tensors: tensors.pop(name))
    with pytest.raises(ModelLoadError, match=f"missing 1 tensor.*{name}"):
        load_model(checkpoint)


def test_missing_lm_head_of_an_untied_model_is_named(checkpoint: Path) -> None:
    rewrite_weights(checkpoint, lambda tensors: tensors.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError, match="lm_head.weight"):
        load_model(checkpoint)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.rotary_proj.weight",  # a module our model lacks
        "model.layers.2.mlp.down_proj.weight",  # a layer beyond num_hidden_layers
        "model.vision_tower.weight",  # outside the decoder altogether
    ],
)
def test_unexpected_tensor_is_named(checkpoint: Path, name: str) -> None:
    rewrite_weights(checkpoint, lambda tensors: tensors.__setitem__(name, torch.zeros(4)))
    with pytest.raises(ModelLoadError, match=f"unexpected tensor '{name}'"):
        load_model(checkpoint)


@pytest.mark.parametrize(
    "name", ["model.layers.0.mlp.up_proj.weight", "model.layers.1.self_attn.q_proj.weight"]
)
def test_misshaped_tensor_is_named(checkpoint: Path, name: str) -> None:
    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name][:-1].clone()

    rewrite_weights(checkpoint, shrink)
    with pytest.raises(ModelLoadError, match=f"tensor '{name}' has shape"):
        load_model(checkpoint)


def test_missing_shard_is_named(tmp_path: Path) -> None:
    folder = make_tiny_checkpoint(tmp_path / "sharded", "llama", max_shard_size="100KB", vocab_size=1024)
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(folder)


def test_damaged_safetensors_file(checkpoint: Path) -> None:
    (checkpoint / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(checkpoint)


def test_malformed_config_json(checkpoint: Path) -> None:
    (checkpoint / "config.json").write_text("{")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load_model(checkpoint)


@pytest.mark.parametrize("field", ["num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size"])
def test_config_without_a_required_field(checkpoint: Path, field: str) -> None:
    edit_config(checkpoint, **{field: None})
    with pytest.raises(ModelLoadError, match=f"lacks required field '{field}'"):
        load_model(checkpoint)


def test_missing_paths(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="no model in"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(qwen3_dict()))
    with pytest.raises(ModelLoadError, match="no weights in"):
        load_model(tmp_path)


# ---- unsupported models -------------------------------------------------------------------------


def test_unsupported_hf_architecture_is_refused(checkpoint: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_dict(qwen3_dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    edit_config(checkpoint, architectures=["GPT2LMHeadModel"], model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        load_model(checkpoint)


def test_unsupported_gguf_architecture_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        ModelConfig.from_gguf_metadata({"general.architecture": "gpt2"})
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        load_model(write_gguf(tmp_path / "gpt2.gguf", "gpt2"))


@pytest.mark.parametrize("layer_type", ["linear_attention", "sliding_attention"])
def test_unsupported_layer_types_are_refused_by_name(checkpoint: Path, layer_type: str) -> None:
    layer_types = ["full_attention", layer_type]
    config = ModelConfig.from_hf_dict(qwen3_dict(layer_types=layer_types))
    assert config.layer_types == tuple(layer_types)  # the config describes it; running it is refused
    with pytest.raises(UnsupportedModelError, match=layer_type):
        config.require_runnable()
    with pytest.raises(UnsupportedModelError, match=layer_type), torch.device("meta"):
        DecoderForCausalLM(config)
    edit_config(checkpoint, layer_types=layer_types)
    with pytest.raises(UnsupportedModelError, match=layer_type):
        load_model(checkpoint)


def test_sliding_window_without_layer_types_is_refused() -> None:
    config = ModelConfig.from_hf_dict(qwen3_dict(sliding_window=64, use_sliding_window=True))
    with pytest.raises(UnsupportedModelError, match="sliding_attention"):
        config.require_runnable()
    ModelConfig.from_hf_dict(qwen3_dict(sliding_window=64, use_sliding_window=False)).require_runnable()


def test_full_attention_layer_types_are_accepted() -> None:
    config = ModelConfig.from_hf_dict(qwen3_dict(layer_types=["full_attention"] * 2))
    config.require_runnable()
    assert config.num_attention_layers == 2
