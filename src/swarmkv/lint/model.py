"""The parts of a model a lint needs: its tokenizer (and chat template) and its KV bytes per token, never
its weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from swarmkv.config import ModelConfig
from swarmkv.models.loader import checkpoint_file_or_dir
from swarmkv.tokenizer import Tokenizer

# Pages are sized at float16, whatever the weights: the figure a GPU deployment holds.
KV_DTYPE = torch.float16


@dataclass(frozen=True)
class LintModel:
    """A model's tokenizer and shape."""

    name: str  # as the server names it: the file stem or folder name
    tokenizer: Tokenizer
    config: ModelConfig

    def page_bytes(self, page_size: int) -> int:
        """Bytes of one KV page of `page_size` tokens at float16."""
        return self.config.kv_bytes_per_token(KV_DTYPE) * page_size


def load_lint_model(path: str | Path | None) -> LintModel:
    """The tokenizer and config of a HF directory or GGUF file (the embedded default model when None)."""
    resolved = checkpoint_file_or_dir(path)
    if resolved.is_file():
        from swarmkv.models.gguf_file import open_gguf  # the gguf package: only for GGUF files

        gguf = open_gguf(resolved)
        has_head = any(t.name == "output.weight" for t in gguf.reader.tensors)
        config = ModelConfig.from_gguf_metadata(gguf.metadata, num_output_tensors=int(has_head))
        return LintModel(resolved.stem, Tokenizer.from_gguf_metadata(gguf.metadata), config)
    return LintModel(resolved.name, Tokenizer.from_hf_dir(resolved), ModelConfig.from_hf_dir(resolved))
