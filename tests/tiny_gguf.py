"""Tiny random GGUF files in any mix of quantized types, written with the `gguf` package's writer and our
quantizer (`models/gguf_quantize.py`: all eight types the grouped layout holds).

`write_tiny_gguf(path, "llama", projections=Q.Q4_K)` writes a two-layer model in llama.cpp's tensor names
and metadata keys, with the embedded SmolLM2 file's tokenizer (so it loads like a real file). Sizes are
multiples of 256, so every K-quant applies. `types` picks a type per tensor name pattern, e.g. the
`Q4_K_M`-like mix `{"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from swarmkv.models.default import default_model_path
from swarmkv.models.gguf_file import open_gguf
from swarmkv.models.gguf_quantize import quantize

Q = GGMLQuantizationType
SHAPE = {"hidden": 256, "intermediate": 512, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 64}


def _tokenizer_metadata(writer: GGUFWriter) -> int:
    """Copy the embedded SmolLM2 file's tokenizer; returns its vocabulary size."""
    meta = open_gguf(default_model_path()).metadata
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(meta["tokenizer.chat_template"])
    return len(meta["tokenizer.ggml.tokens"])


def tiny_tensors(arch: str, vocab: int, tied: bool, seed: int) -> dict[str, torch.Tensor]:
    """llama.cpp-named random weights [out, in] (norms 1-D) of the tiny shape."""
    hidden, inter = SHAPE["hidden"], SHAPE["intermediate"]
    q_rows, kv_rows = SHAPE["heads"] * SHAPE["head_dim"], SHAPE["kv_heads"] * SHAPE["head_dim"]
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    tensors = {"token_embd.weight": rand(vocab, hidden, scale=0.5)}
    for layer in range(SHAPE["layers"]):
        block = f"blk.{layer}."
        tensors |= {
            block + "attn_norm.weight": 1 + rand(hidden, scale=0.1),
            block + "attn_q.weight": rand(q_rows, hidden),
            block + "attn_k.weight": rand(kv_rows, hidden),
            block + "attn_v.weight": rand(kv_rows, hidden),
            block + "attn_output.weight": rand(hidden, q_rows),
            block + "ffn_norm.weight": 1 + rand(hidden, scale=0.1),
            block + "ffn_gate.weight": rand(inter, hidden),
            block + "ffn_up.weight": rand(inter, hidden),
            block + "ffn_down.weight": rand(hidden, inter),
        }
        if arch == "qwen3":
            tensors[block + "attn_q_norm.weight"] = 1 + rand(SHAPE["head_dim"], scale=0.1)
            tensors[block + "attn_k_norm.weight"] = 1 + rand(SHAPE["head_dim"], scale=0.1)
    tensors["output_norm.weight"] = 1 + rand(hidden, scale=0.1)
    if not tied:
        tensors["output.weight"] = rand(vocab, hidden, scale=0.1)
    return tensors


def tensor_type(name: str, types: dict[str, GGMLQuantizationType], default: GGMLQuantizationType) -> Q:
    """The type `name` is written in: the first pattern of `types` it contains, else `default`; norms F32."""
    if name.endswith("norm.weight"):
        return Q.F32
    return next((kind for pattern, kind in types.items() if pattern in name), default)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    projections: GGMLQuantizationType = Q.Q4_K,
    embedding: GGMLQuantizationType = Q.Q8_0,
    types: dict[str, GGMLQuantizationType] | None = None,
    tied: bool = True,
    seed: int = 0,
) -> Path:
    """Write the tiny model to `path`; return `path`."""
    writer = GGUFWriter(path, arch)
    vocab = _tokenizer_metadata(writer)
    writer.add_block_count(SHAPE["layers"])
    writer.add_context_length(512)
    writer.add_embedding_length(SHAPE["hidden"])
    writer.add_feed_forward_length(SHAPE["intermediate"])
    writer.add_head_count(SHAPE["heads"])
    writer.add_head_count_kv(SHAPE["kv_heads"])
    writer.add_key_length(SHAPE["head_dim"])
    writer.add_value_length(SHAPE["head_dim"])
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    chosen = {"token_embd": embedding, "output.weight": embedding, **(types or {})}
    for name, weight in tiny_tensors(arch, vocab, tied, seed).items():
        kind = tensor_type(name, chosen, projections)
        if kind == Q.F32:
            writer.add_tensor(name, weight.numpy().astype(np.float32))
        elif kind == Q.F16:
            writer.add_tensor(name, weight.numpy().astype(np.float16))
        else:
            writer.add_tensor(name, quantize(weight, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
