"""Architecture name -> model class; the one place a new family is registered."""

from __future__ import annotations

from torch import nn

from swarmkv.config import Architecture, ModelConfig
from swarmkv.models.decoder import DecoderForCausalLM
from swarmkv.models.quantized import WeightFormat

MODEL_CLASSES: dict[Architecture, type[nn.Module]] = {
    "llama": DecoderForCausalLM,
    "qwen2": DecoderForCausalLM,
    "qwen3": DecoderForCausalLM,
    "qwen3_5": DecoderForCausalLM,
}


def build_model(config: ModelConfig, weights: WeightFormat = "float") -> DecoderForCausalLM:
    """Instantiate the model class registered for `config.architecture`, its projections in `weights`."""
    model = MODEL_CLASSES[config.architecture](config, weights)
    assert isinstance(model, DecoderForCausalLM)
    return model
