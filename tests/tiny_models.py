"""Tiny random Hugging Face checkpoints (Llama, Qwen2, Qwen3) that tests build with transformers itself.

`make_tiny_checkpoint(folder, "qwen3")` writes config.json, model.safetensors (or shards plus
model.safetensors.index.json) and the Qwen3 tokenizer files, so the folder loads like a real model
repo in both swarmkv and transformers. Weights are random but seeded, drawn wider than transformers'
default init so attention is peaked, and biases and norm weights are random too, so a wrong rotary,
bias or norm shows in the logits.
"""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path
from typing import Any, Literal

import torch

# Sets HF_HUB_OFFLINE before transformers is imported anywhere.
from conftest_tokenizer_helpers import qwen_dir

TinyArch = Literal["llama", "qwen2", "qwen3"]

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


@cache
def qwen_vocab_size() -> int:
    """Rows the Qwen3 tokenizer needs (base vocabulary plus added tokens): every id it emits is valid."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(qwen_dir() / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def tiny_hf_config(arch: TinyArch, **overrides: Any) -> Any:
    """A transformers config of the given family at the tiny shape (vocabulary: the Qwen3 tokenizer's)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    config_class = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch]
    return config_class(**{**TINY_SHAPE, "vocab_size": qwen_vocab_size(), **overrides})


def make_tiny_checkpoint(
    folder: Path,
    arch: TinyArch = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **overrides: Any,
) -> Path:
    """Save a seeded random `arch` model with the Qwen3 tokenizer into `folder`; return `folder`.

    `overrides` go to the transformers config (e.g. tie_word_embeddings=True, rope_parameters={...});
    `max_shard_size` (e.g. "2MB") splits the weights into shards with an index file.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise_constant_init(model)
    folder.mkdir(parents=True, exist_ok=True)
    save_kwargs: dict[str, Any] = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, safe_serialization=True, **save_kwargs)
    for name in TOKENIZER_FILES:
        shutil.copyfile(qwen_dir() / name, folder / name)
    return folder


def _randomise_constant_init(model: torch.nn.Module) -> None:
    """Give biases (zeros) and norm weights (ones) random values, so a mis-loaded one changes the logits."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.normal_(1.0, 0.2)


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
