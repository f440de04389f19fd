"""Tiny random Hugging Face checkpoints (Llama, Qwen2, Qwen3, Qwen3.5) that tests build with transformers.

`make_tiny_checkpoint(folder, "qwen3")` writes config.json, model.safetensors (or shards plus
model.safetensors.index.json) and the Qwen3 tokenizer files, so the folder loads like a real model
repo in both swarmkv and transformers. Weights are random but seeded, drawn wider than transformers'
default init so attention is peaked, and biases and norm weights are random too, so a wrong rotary,
bias or norm shows in the logits. For Qwen3.5: `make_tiny_qwen3_5_multimodal_checkpoint` writes the
layout of the released repos (text weights under `model.language_model.`, a vision tower),
`lengthen_recurrent_memory` slows the states' decay so a lost state shows, and `float64_throughout` makes
transformers' float64 model an exact reference.
"""

from __future__ import annotations

import atexit
import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any, Literal
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

# Sets HF_HUB_OFFLINE before transformers is imported anywhere.
from conftest_tokenizer_helpers import qwen_dir

TinyArch = Literal["llama", "qwen2", "qwen3", "qwen3_5"]

# The tokenizer files a checkpoint folder needs; vocab.json and merges.txt are only for slow tokenizers.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

TINY_SHAPE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    # transformers' default 0.02 leaves attention almost uniform, hiding rotary mistakes.
    "initializer_range": 0.2,
}

# Qwen3.5: three Gated DeltaNet (linear-attention) layers, then one gated full-attention layer.
QWEN3_5_LAYER_TYPES = ("linear_attention", "linear_attention", "linear_attention", "full_attention")
QWEN3_5_SHAPE: dict[str, Any] = {
    "num_hidden_layers": len(QWEN3_5_LAYER_TYPES),
    "layer_types": list(QWEN3_5_LAYER_TYPES),
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}
# A vision tower the text-only loader must skip; its shape only needs to be plausible.
TINY_VISION_CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5_vision",
    "depth": 1,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "patch_size": 16,
    "out_hidden_size": 64,
}


@cache
def qwen_vocab_size() -> int:
    """Rows the Qwen3 tokenizer needs (base vocabulary plus added tokens): every id it emits is valid."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(qwen_dir() / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def tiny_hf_config(arch: TinyArch, **overrides: Any) -> Any:
    """A transformers config of the given family at the tiny shape (vocabulary: the Qwen3 tokenizer's)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3_5TextConfig, Qwen3Config

    config_class = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "qwen3_5": Qwen3_5TextConfig,
    }[arch]
    family_shape = QWEN3_5_SHAPE if arch == "qwen3_5" else {}
    if "layer_types" in overrides:
        overrides.setdefault("num_hidden_layers", len(overrides["layer_types"]))
    return config_class(**{**TINY_SHAPE, **family_shape, "vocab_size": qwen_vocab_size(), **overrides})


def make_tiny_checkpoint(
    folder: Path,
    arch: TinyArch = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> Path:
    """Save a seeded random `arch` model with the Qwen3 tokenizer into `folder`; return `folder`.

    `overrides` go to the transformers config (e.g. tie_word_embeddings=True, rope_parameters={...},
    layer_types=[...] for qwen3_5, which also sets the layer count); `max_shard_size` (e.g. "2MB")
    splits the weights into shards with an index file. A process builds each set of arguments once and copies
    it into every folder that asks for it.
    """
    key = repr((arch, seed, max_shard_size, sorted(overrides.items())))
    if key not in _BUILT:
        built = Path(tempfile.mkdtemp(prefix="swarmkv-tiny-", dir=_scratch()))
        _build_tiny_checkpoint(built, arch, seed, max_shard_size, **overrides)
        _BUILT[key] = (built, torch.get_rng_state())
    built, rng_state = _BUILT[key]
    # A copy, which the caller may edit, and torch's global generator left as a build leaves it.
    shutil.copytree(built, folder, dirs_exist_ok=True)
    torch.set_rng_state(rng_state)
    return folder


# Each process's (each xdist worker's) checkpoints by their arguments, built once: a checkpoint with the real
# vocabulary is 78 MB, and the suite asks for the same few many times. Entries: the folder, and torch's
# generator state after the build.
_BUILT: dict[str, tuple[Path, torch.Tensor]] = {}


@cache
def _scratch() -> Path:
    """A folder for the built checkpoints, removed when the process exits."""
    folder = Path(tempfile.mkdtemp(prefix="swarmkv-tiny-checkpoints-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def _build_tiny_checkpoint(
    folder: Path, arch: TinyArch, seed: int, max_shard_size: str | int | None, **overrides: Any
) -> None:
    """Save the seeded random model into `folder` (see `make_tiny_checkpoint`)."""
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise_constant_init(model)
    save_kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, safe_serialization=True, **save_kwargs)
    for name in TOKENIZER_FILES:
        shutil.copyfile(qwen_dir() / name, folder / name)


def _randomise_constant_init(model: torch.nn.Module) -> None:
    """Give biases (zeros) and norm weights (constant) random values, so a mis-loaded one changes the logits.

    Norm weights are drawn around their initial value: ones, or zeros where the model scales by 1 + weight
    (Qwen3.5's RMSNorm). Qwen3.5's A_log and dt_bias keep transformers' init, so the recurrent decay
    -exp(A_log) * softplus(a + dt_bias) stays negative (`lengthen_recurrent_memory` makes it slower).
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.normal_(0.0 if bool((param == 0).all()) else 1.0, 0.2)


def make_tiny_qwen3_5_multimodal_checkpoint(folder: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Save the tiny Qwen3.5 as a `Qwen3_5ForConditionalGeneration` repo into `folder`; return `folder`.

    Same text weights as `make_tiny_checkpoint(folder, "qwen3_5", seed=seed, **overrides)`, renamed the
    way the released repos store them (`model.language_model.*`, `lm_head.weight` at the top), plus a
    few `model.visual.*` tensors, and config.json nesting the text config under "text_config".
    """
    make_tiny_checkpoint(folder, "qwen3_5", seed=seed, **overrides)
    weights_path = folder / "model.safetensors"
    text = load_file(weights_path)
    tensors = {_multimodal_name(name): tensor for name, tensor in text.items()}
    generator = torch.Generator().manual_seed(seed)
    vision = TINY_VISION_CONFIG
    tensors["model.visual.patch_embed.proj.weight"] = torch.randn(
        vision["hidden_size"], 3, 2, vision["patch_size"], vision["patch_size"], generator=generator
    )
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.randn(
        3 * vision["hidden_size"], vision["hidden_size"], generator=generator
    )
    tensors["model.visual.merger.linear_fc2.weight"] = torch.randn(
        vision["out_hidden_size"], vision["hidden_size"], generator=generator
    )
    save_file(tensors, weights_path, metadata={"format": "pt"})

    config_path = folder / "config.json"
    text_config = json.loads(config_path.read_text())
    text_config.pop("architectures", None)
    text_config["model_type"] = "qwen3_5_text"
    multimodal = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": text_config.get("tie_word_embeddings", False),
        "image_token_id": 248056,
        "video_token_id": 248057,
        "vision_start_token_id": 248053,
        "vision_end_token_id": 248054,
        "text_config": text_config,
        "vision_config": dict(TINY_VISION_CONFIG),
        "transformers_version": text_config.get("transformers_version"),
    }
    config_path.write_text(json.dumps(multimodal, indent=2))
    return folder


def lengthen_recurrent_memory(folder: Path, max_rate: float = 0.1, seed: int = 0) -> Path:
    """Redraw the A_log of every linear-attention layer in `folder`'s Qwen3.5 weights so that A = exp(A_log)
    is uniform in [0.01, max_rate]; return `folder`.

    transformers' init draws A from [0.01, 16]: with dt_bias 1 a state decays by exp(-A * softplus(a + 1))
    per token, so most heads forget within a token or two, and a state lost or mixed up between requests
    barely shows in greedy outputs. Rates up to 0.1 keep a half-life of some 5 to 50 tokens, and the decay
    stays negative.
    """
    path = folder / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in tensors.items():
        if name.endswith("linear_attn.A_log"):
            rates = torch.empty(tensor.shape, dtype=torch.float64).uniform_(
                0.01, max_rate, generator=generator
            )
            tensors[name] = rates.log().to(tensor.dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    return folder


@contextmanager
def float64_throughout(model: Any) -> Iterator[None]:
    """While transformers' float64 Qwen3.5 `model` runs, make its float32 casts float64, rotary aside.

    transformers computes RMSNorm, the decay and the delta rule in float32 even in a float64 model, which
    leaves its logits ~1e-4 from exact. Lifted, its chunked prefill and token-by-token decode agree to
    ~1e-13. Its rotary angles stay float32, as swarmkv's rotary tables are in every dtype.
    """
    lifting = True
    to, as_float = torch.Tensor.to, torch.Tensor.float

    def lifted_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if lifting:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return to(self, *args, **kwargs)

    def lifted_float(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.double(*args, **kwargs) if lifting else as_float(self, *args, **kwargs)

    rotary = model.model.rotary_emb
    rotary_forward = rotary.forward

    def float32_rotary(*args: Any, **kwargs: Any) -> Any:
        nonlocal lifting
        lifting = False
        try:
            return rotary_forward(*args, **kwargs)
        finally:
            lifting = True

    with (
        mock.patch.object(torch.Tensor, "float", lifted_float),
        mock.patch.object(torch.Tensor, "to", lifted_to),
        mock.patch.object(rotary, "forward", float32_rotary),
    ):
        yield


def _multimodal_name(name: str) -> str:
    """`model.layers.0...` -> `model.language_model.layers.0...`; `lm_head.weight` stays at the top."""
    prefix = "model."
    return f"model.language_model.{name[len(prefix) :]}" if name.startswith(prefix) else name


def edit_config(folder: Path, **changes: Any) -> None:
    """Overwrite top-level keys of `folder`/config.json (a value of None removes the key)."""
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw, indent=2))
