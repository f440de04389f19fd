"""Tiny random GGUF files in any mix of quantized types, written with the `gguf` package's writer and our
quantizer (`models/gguf_quantize.py`: all eight types the grouped layout holds).

`write_tiny_gguf(path, "llama", projections=Q.Q4_K)` writes a two-layer model in llama.cpp's tensor names
and metadata keys, with the embedded SmolLM2 file's tokenizer (so it loads like a real file). Sizes are
multiples of 256, so every K-quant applies. `types` picks a type per tensor name pattern, e.g. the
`Q4_K_M`-like mix `{"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}`. `arch="qwen35"` writes llama.cpp's Qwen3.5 tensors
and keys (as tests/fixtures/qwen35-tiny's converted file has them), two Gated DeltaNet layers and a gated
attention one.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter

from swarmkv.models.default import default_model_path
from swarmkv.models.gguf_file import open_gguf
from swarmkv.models.gguf_quantize import quantize

Q = GGMLQuantizationType
SHAPE = {"hidden": 256, "intermediate": 512, "layers": 2, "heads": 4, "kv_heads": 2, "head_dim": 64}
# qwen35: two Gated DeltaNet layers, then one gated full-attention layer; every row a multiple of 256.
QWEN35 = {
    "layers": ("linear", "linear", "full"),
    "key_heads": 2,
    "value_heads": 4,
    "key_dim": 64,
    "value_dim": 64,
}
QWEN35_CONV = 4
VOCAB = 1024  # the first tokens of SmolLM2's vocabulary


@cache
def _smollm_tokenizer(vocab: int) -> tuple[list[str], list[int], list[str], dict[str, Any]]:
    """The embedded SmolLM2 tokenizer cut to its first `vocab` tokens, with the merges among them (a
    consistent byte-level BPE: its first tokens are the specials and every byte)."""
    meta = open_gguf(default_model_path()).metadata
    tokens = meta["tokenizer.ggml.tokens"][:vocab]
    kept = set(tokens)
    merges = [m for m in meta["tokenizer.ggml.merges"] if (p := m.split(" ")) and {*p, "".join(p)} <= kept]
    return tokens, meta["tokenizer.ggml.token_type"][:vocab], merges, meta


def _tokenizer_metadata(writer: GGUFWriter, vocab: int = VOCAB) -> int:
    """The cut SmolLM2 tokenizer (small, so the file opens fast); returns its vocabulary size."""
    tokens, types, merges, meta = _smollm_tokenizer(vocab)
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(meta["tokenizer.chat_template"])
    return len(tokens)


def tiny_tensors(arch: str, vocab: int, tied: bool, seed: int, mtp: bool = False) -> dict[str, torch.Tensor]:
    """llama.cpp-named random weights [out, in] (norms 1-D) of the tiny shape; `mtp`: a qwen35 file's MTP
    block too (drawn last, so the other tensors are those of the file without it)."""
    hidden, inter = SHAPE["hidden"], SHAPE["intermediate"]
    q_rows, kv_rows = SHAPE["heads"] * SHAPE["head_dim"], SHAPE["kv_heads"] * SHAPE["head_dim"]
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * scale

    tensors = {"token_embd.weight": rand(vocab, hidden, scale=0.5)}
    if arch == "qwen35":
        tensors |= _qwen35_layers(rand) | _head(rand, vocab, tied)
        return tensors | (_qwen35_mtp(rand) if mtp else {})
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
    return tensors | _head(rand, vocab, tied)


def _head(rand: Any, vocab: int, tied: bool) -> dict[str, torch.Tensor]:
    out = {"output_norm.weight": 1 + rand(SHAPE["hidden"], scale=0.1)}
    if not tied:
        out["output.weight"] = rand(vocab, SHAPE["hidden"], scale=0.1)
    return out


def _qwen35_layers(rand: Any) -> dict[str, torch.Tensor]:
    """llama.cpp's qwen35 layer tensors (norms stored as 1 + w, A as -exp(A_log), conv taps [K, C])."""
    hidden, inter = SHAPE["hidden"], SHAPE["intermediate"]
    heads, kv_heads, head_dim = SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    value_heads = QWEN35["value_heads"]
    value = value_heads * QWEN35["value_dim"]
    conv = 2 * QWEN35["key_heads"] * QWEN35["key_dim"] + value
    tensors: dict[str, torch.Tensor] = {}
    for layer, kind in enumerate(QWEN35["layers"]):
        block = f"blk.{layer}."
        tensors |= {
            block + "attn_norm.weight": 1 + rand(hidden, scale=0.1),
            block + "post_attention_norm.weight": 1 + rand(hidden, scale=0.1),
            block + "ffn_gate.weight": rand(inter, hidden),
            block + "ffn_up.weight": rand(inter, hidden),
            block + "ffn_down.weight": rand(hidden, inter),
        }
        if kind == "linear":
            tensors |= {
                block + "attn_qkv.weight": rand(conv, hidden),
                block + "attn_gate.weight": rand(value, hidden),
                block + "ssm_alpha.weight": rand(value_heads, hidden),
                block + "ssm_beta.weight": rand(value_heads, hidden),
                block + "ssm_a": -torch.exp(rand(value_heads, scale=0.5)),
                block + "ssm_dt.bias": rand(value_heads, scale=0.5),
                block + "ssm_conv1d.weight": rand(conv, QWEN35_CONV, scale=0.3),
                block + "ssm_norm.weight": 1 + rand(QWEN35["value_dim"], scale=0.1),
                block + "ssm_out.weight": rand(hidden, value),
            }
        else:
            tensors |= {
                block + "attn_q.weight": rand(
                    2 * heads * head_dim, hidden
                ),  # each head's query, then its gate
                block + "attn_k.weight": rand(kv_heads * head_dim, hidden),
                block + "attn_v.weight": rand(kv_heads * head_dim, hidden),
                block + "attn_output.weight": rand(hidden, heads * head_dim),
                block + "attn_q_norm.weight": 1 + rand(head_dim, scale=0.1),
                block + "attn_k_norm.weight": 1 + rand(head_dim, scale=0.1),
            }
    return tensors


def _qwen35_mtp(rand: Any) -> dict[str, torch.Tensor]:
    """llama.cpp's MTP block after the decoder's layers: a gated full-attention layer and the nextn tensors
    (norms stored as 1 + w, as its converter stores every Qwen3.5 norm)."""
    hidden, inter = SHAPE["hidden"], SHAPE["intermediate"]
    heads, kv_heads, head_dim = SHAPE["heads"], SHAPE["kv_heads"], SHAPE["head_dim"]
    block = f"blk.{len(QWEN35['layers'])}."
    return {
        block + "attn_norm.weight": 1 + rand(hidden, scale=0.1),
        block + "post_attention_norm.weight": 1 + rand(hidden, scale=0.1),
        block + "ffn_gate.weight": rand(inter, hidden),
        block + "ffn_up.weight": rand(inter, hidden),
        block + "ffn_down.weight": rand(hidden, inter),
        block + "attn_q.weight": rand(2 * heads * head_dim, hidden),
        block + "attn_k.weight": rand(kv_heads * head_dim, hidden),
        block + "attn_v.weight": rand(kv_heads * head_dim, hidden),
        block + "attn_output.weight": rand(hidden, heads * head_dim),
        block + "attn_q_norm.weight": 1 + rand(head_dim, scale=0.1),
        block + "attn_k_norm.weight": 1 + rand(head_dim, scale=0.1),
        block + "nextn.eh_proj.weight": rand(hidden, 2 * hidden),
        block + "nextn.enorm.weight": 1 + rand(hidden, scale=0.1),
        block + "nextn.hnorm.weight": 1 + rand(hidden, scale=0.1),
        block + "nextn.shared_head_norm.weight": 1 + rand(hidden, scale=0.1),
    }


def _qwen35_metadata(writer: GGUFWriter, mtp: bool = False) -> None:
    kinds = QWEN35["layers"]
    writer.add_uint32("qwen35.ssm.conv_kernel", QWEN35_CONV)
    writer.add_uint32("qwen35.ssm.state_size", QWEN35["key_dim"])
    writer.add_uint32("qwen35.ssm.group_count", QWEN35["key_heads"])
    writer.add_uint32("qwen35.ssm.time_step_rank", QWEN35["value_heads"])
    writer.add_uint32("qwen35.ssm.inner_size", QWEN35["value_heads"] * QWEN35["value_dim"])
    recurrent = [kind == "linear" for kind in kinds] + [False] * mtp  # the MTP block: full attention
    writer.add_array("qwen35.attention.recurrent_layers", recurrent)
    if mtp:
        writer.add_uint32("qwen35.nextn_predict_layers", 1)
    writer.add_uint32("qwen35.full_attention_interval", len(kinds))
    writer.add_uint32("qwen35.rope.dimension_count", SHAPE["head_dim"] // 4)


def tensor_type(name: str, types: dict[str, GGMLQuantizationType], default: GGMLQuantizationType) -> Q:
    """The type `name` is written in: `types[name]` where it names the tensor, else the first pattern of `types`
    it contains, else `default`; norms F32."""
    if name.endswith("norm.weight"):
        return Q.F32
    if name in types:
        return types[name]
    return next((kind for pattern, kind in types.items() if pattern in name), default)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    projections: GGMLQuantizationType = Q.Q4_K,
    embedding: GGMLQuantizationType = Q.Q8_0,
    types: dict[str, GGMLQuantizationType] | None = None,
    tied: bool = True,
    seed: int = 0,
    mtp: bool = False,
) -> Path:
    """Write the tiny model to `path` (`mtp`: a qwen35 file with an MTP block, as llama.cpp's converter keeps
    it); return `path`."""
    writer = GGUFWriter(path, arch)
    vocab = _tokenizer_metadata(writer)
    writer.add_block_count(len(QWEN35["layers"]) + mtp if arch == "qwen35" else SHAPE["layers"])
    if arch == "qwen35":
        _qwen35_metadata(writer, mtp)
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
    for name, weight in tiny_tensors(arch, vocab, tied, seed, mtp).items():
        kind = tensor_type(name, chosen, projections)
        if kind == Q.F32 or weight.dim() == 1 or "ssm_conv1d" in name:  # llama.cpp keeps these float
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


def rewrite_gguf(
    source: Path, out: Path, replace: dict[str, tuple[np.ndarray, GGMLQuantizationType]]
) -> Path:
    """Copy a GGUF file with some tensors replaced by raw blocks of another type: {name: (bytes, type)}."""
    from gguf import GGUFReader

    reader = GGUFReader(source)
    writer = GGUFWriter(out, str(reader.fields["general.architecture"].contents()))
    for field in reader.fields.values():
        if not field.name.startswith("GGUF.") and field.name != "general.architecture":
            sub = field.types[-1] if len(field.types) > 1 else None
            writer.add_key_value(field.name, field.contents(), field.types[0], sub)
    for tensor in reader.tensors:
        raw, kind = replace.get(tensor.name, (tensor.data, tensor.tensor_type))
        writer.add_tensor(tensor.name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
