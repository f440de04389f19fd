"""The founding document's setup: Qwen3.5-9B as llama.cpp's `Q4_K_M`, on a 16 GiB card, 8,192 tokens per agent.

The test writes the file's header only (tensor infos with the real names, shapes and types; the 5 GB data section
is left sparse: `truncate`, never written) and plans it: the weights exactly as held, and the agents that fit.

Where every number comes from:
- Qwen3.5-9B's text config (Qwen/Qwen3.5-9B config.json, text_config): 32 layers, `layer_types` three
  linear_attention then one full_attention, eight times (`full_attention_interval` 4); hidden 4096; 16 attention
  heads of 256 with 4 KV heads and an output gate (`attn_output_gate`: q_proj is 2 x 16 x 256 rows); Gated
  DeltaNet with 16 key heads and 32 value heads of 128, conv kernel 4; intermediate 12288; vocab 248320;
  `tie_word_embeddings` false; `mtp_num_hidden_layers` 1; 262,144 positions; rope_theta 1e7, partial rotary 0.25.
  Read from a public test fixture that copies the checkpoint's config (its docstring: "run against the real
  Qwen3.5-9B config", with the checkpoint's index listing `lm_head.weight`, total_size 19,306,216,416), and
  matching tests/test_plan.py's QWEN35_9B_TEXT and llama.cpp's example for this class (Qwen/Qwen3.5-9B).
- Tensor names and shapes: llama.cpp's conversion (llama-cpp-python 0.3.36's vendor/llama.cpp,
  conversion/qwen.py: Qwen3_5TextModel <- _LinearAttentionVReorderBase <- Qwen3NextModel <- _QwenMtpMixin).
  The V-head reorder permutes rows and columns, not shapes. in_proj_qkv -> attn_qkv, in_proj_z -> attn_gate,
  in_proj_b/a -> ssm_beta/ssm_alpha, conv1d [8192, 1, 4] squeezed -> ssm_conv1d (ne [4, 8192], always F32),
  A_log -> ssm_a, dt_bias -> ssm_dt.bias, norm -> ssm_norm, out_proj -> ssm_out. The MTP head is converted by
  default (no --no-mtp): block_count 33, `qwen35.nextn_predict_layers` 1, block 32 a full-attention layer plus
  nextn.eh_proj [8192 -> 4096] and three norms. 1-D tensors and norms are F32 (conversion/base.py).
- Types: llama.cpp's quantizer (src/llama-quant.cpp, same tree), LLAMA_FTYPE_MOSTLY_Q4_K_M, no imatrix,
  followed literally: default Q4_K; tensors in the loader's order (by block, then name); output.weight Q6_K; the
  untied token_embd keeps Q4_K; attn_v and attn_qkv (both "attn_v-like") and ffn_down get Q6_K where
  use_more_bits(i, n) (i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2) with n = 33 (the MTP block counts); the
  ATTENTION_QKV -> Q5_K branch is never reached, the attn_v-like branch comes first. Every quantized tensor's
  ne0 (4096, 8192, 12288) divides by 256, so no fallback applies. Norms, ssm_conv1d, ssm_a, ssm_dt stay F32.
- Cross-checks against published files: the model's tensors without the MTP head come to 5,618,141,184 bytes
  (5.23 GiB); a Qwen3.5-9B Q4_K_M model card lists "Q4_K_M 5.6e9" (steampunque/Qwen3.5-9B-MP-GGUF) and a
  review of one "8.95B (quantized Q4_K-M, 5.23 GB)"; another card counts "250 weight tensors" (the 2-D ones
  here, 217 Q4_K + 33 Q6_K, without the MTP head's).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from gguf import GGMLQuantizationType

from swarmkv.cli import main
from swarmkv.models.gguf_quants import held_bytes
from swarmkv.plan.shape import KVShape, RecurrentState
from swarmkv.plan.table import VramBudget, fit_agents
from test_plan_gguf import TensorSpec, file_bytes, plan_json, write_header_only_gguf

Q = GGMLQuantizationType
GIB = 1024**3
LAYERS, MTP = 32, 1
BLOCKS = LAYERS + MTP
HIDDEN, INTER, VOCAB = 4096, 12288, 248320
HEADS, KV_HEADS, HEAD_DIM = 16, 4, 256
K_HEADS, V_HEADS, K_DIM, V_DIM, CONV = 16, 32, 128, 128, 4
QKV = 2 * K_HEADS * K_DIM + V_HEADS * V_DIM  # 8192: the conv's channels
CONTEXT = 262144


def is_linear(block: int) -> bool:
    """layer_types: every fourth layer full attention; the MTP block is a full-attention layer."""
    return block < LAYERS and (block + 1) % 4 != 0


def use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's use_more_bits (integer division as in C++; i - n/8 >= 0 whenever it is evaluated)."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m(name: str, block: int | None, blocks: int = BLOCKS) -> GGMLQuantizationType:
    """The type llama_tensor_get_type gives a 2-D weight of this file (of `blocks` blocks) under Q4_K_M."""
    if name == "output.weight":
        return Q.Q6_K
    part = name.split(".")[-2] if block is not None else ""
    if part in ("attn_v", "attn_qkv", "ffn_down") and block is not None and use_more_bits(block, blocks):
        return Q.Q6_K
    return Q.Q4_K


def block_tensors(b: int) -> list[tuple[str, tuple[int, ...]]]:
    """One block's tensors as llama.cpp's conversion names them, GGUF shapes (ne0 first)."""
    out = [
        ("attn_norm.weight", (HIDDEN,)),
        ("post_attention_norm.weight", (HIDDEN,)),
        ("ffn_gate.weight", (HIDDEN, INTER)),
        ("ffn_up.weight", (HIDDEN, INTER)),
        ("ffn_down.weight", (INTER, HIDDEN)),
    ]
    if is_linear(b):
        out += [
            ("attn_qkv.weight", (HIDDEN, QKV)),
            ("attn_gate.weight", (HIDDEN, V_HEADS * V_DIM)),
            ("ssm_beta.weight", (HIDDEN, V_HEADS)),
            ("ssm_alpha.weight", (HIDDEN, V_HEADS)),
            ("ssm_conv1d.weight", (CONV, QKV)),
            ("ssm_dt.bias", (V_HEADS,)),
            ("ssm_a", (V_HEADS,)),
            ("ssm_norm.weight", (V_DIM,)),
            ("ssm_out.weight", (V_HEADS * V_DIM, HIDDEN)),
        ]
    else:
        out += [
            ("attn_q.weight", (HIDDEN, 2 * HEADS * HEAD_DIM)),  # q and its output gate
            ("attn_k.weight", (HIDDEN, KV_HEADS * HEAD_DIM)),
            ("attn_v.weight", (HIDDEN, KV_HEADS * HEAD_DIM)),
            ("attn_output.weight", (HEADS * HEAD_DIM, HIDDEN)),
            ("attn_q_norm.weight", (HEAD_DIM,)),
            ("attn_k_norm.weight", (HEAD_DIM,)),
        ]
    if b >= LAYERS:  # the MTP head: fc, and its three norms
        out += [
            ("nextn.eh_proj.weight", (2 * HIDDEN, HIDDEN)),
            ("nextn.enorm.weight", (HIDDEN,)),
            ("nextn.hnorm.weight", (HIDDEN,)),
            ("nextn.shared_head_norm.weight", (HIDDEN,)),
        ]
    return out


def qwen35_9b_q4_k_m(blocks: int = BLOCKS) -> list[TensorSpec]:
    """Every tensor of the file, in llama-quantize's output order: global tensors, then by block and name.
    `blocks` is 32 for a file converted with --no-mtp."""
    named: list[tuple[str, int | None, tuple[int, ...]]] = [
        ("output.weight", None, (HIDDEN, VOCAB)),
        ("output_norm.weight", None, (HIDDEN,)),
        ("token_embd.weight", None, (HIDDEN, VOCAB)),
    ]
    for b in range(blocks):
        named += sorted((f"blk.{b}.{n}", b, shape) for n, shape in block_tensors(b))
    tensors: list[TensorSpec] = []
    for name, block, shape in named:
        quantized = (
            len(shape) == 2 and name.endswith("weight") and "_norm." not in name and "ssm_conv1d" not in name
        )
        tensors.append((name, q4_k_m(name, block, blocks) if quantized else Q.F32, shape))
    return tensors


METADATA: dict[str, Any] = {
    "general.name": "Qwen3.5-9B",
    "general.file_type": 15,  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    "qwen35.block_count": BLOCKS,
    "qwen35.nextn_predict_layers": MTP,
    "qwen35.context_length": CONTEXT,
    "qwen35.embedding_length": HIDDEN,
    "qwen35.feed_forward_length": INTER,
    "qwen35.attention.head_count": HEADS,
    "qwen35.attention.head_count_kv": KV_HEADS,
    "qwen35.attention.key_length": HEAD_DIM,
    "qwen35.attention.value_length": HEAD_DIM,
    "qwen35.attention.layer_norm_rms_epsilon": 1e-6,
    "qwen35.rope.freq_base": 1e7,
    "qwen35.rope.dimension_count": HEAD_DIM // 4,
    "qwen35.rope.dimension_sections": [11, 11, 10, 0],
    "qwen35.ssm.conv_kernel": CONV,
    "qwen35.ssm.state_size": K_DIM,
    "qwen35.ssm.group_count": K_HEADS,
    "qwen35.ssm.time_step_rank": V_HEADS,
    "qwen35.ssm.inner_size": V_HEADS * V_DIM,
    "qwen35.full_attention_interval": 4,
    "qwen35.attention.recurrent_layers": [is_linear(b) for b in range(BLOCKS)],
}


def held_here(tensors: list[TensorSpec]) -> int:
    """The loader's contract, computed from the shapes: quantized blocks through held_bytes, F32 at the compute
    dtype's 2 bytes, the MTP block (32) not held."""
    total = 0
    for name, kind, shape in tensors:
        if name.startswith(f"blk.{LAYERS}."):
            continue
        rows, cols = math.prod(shape[1:]), shape[0]
        total += rows * cols * 2 if kind == Q.F32 else held_bytes(kind, rows, cols)
    return total


@pytest.fixture(scope="module")
def nine_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("qwen35") / "Qwen3.5-9B-Q4_K_M.gguf"
    return write_header_only_gguf(path, "qwen35", METADATA, qwen35_9b_q4_k_m())


def test_the_file_is_header_only(nine_b: Path) -> None:
    tensors = qwen35_9b_q4_k_m()
    stat = nine_b.stat()
    assert stat.st_size > sum(file_bytes(k, s) for _, k, s in tensors) > 5 * 10**9
    assert stat.st_blocks * 512 < 16 * 2**20  # sparse: the data section was never written


def test_weights_held_exactly(nine_b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tensors = qwen35_9b_q4_k_m()
    out = plan_json(capsys, "--model", str(nine_b))
    weights = out["gguf_weights"]
    assert weights["held_bytes"] == held_here(tensors) == 5_720_876_032
    file_total = sum(file_bytes(k, s) for _, k, s in tensors)
    mtp = sum(file_bytes(k, s) for n, k, s in tensors if n.startswith(f"blk.{LAYERS}."))
    assert (weights["file_tensor_bytes"], weights["held_file_bytes"]) == (file_total, file_total - mtp)
    assert weights["skipped"]["tensors"] == 15 and weights["skipped"]["file_bytes"] == mtp
    assert weights["held_bytes"] / weights["held_file_bytes"] <= 1.03
    assert weights["converted"] == [] and not weights["tied_embeddings"]
    rows = {r["type"]: (r["tensors"], r["held_as"]) for r in weights["types"]}
    # Q6_K: output.weight, and attn_v / attn_qkv and ffn_down of 16 use_more_bits layers of 0..31.
    assert rows == {"Q4_K": (217, "Q4_K"), "Q6_K": (33, "Q6_K"), "F32": (177, "float16")}
    # The hybrid's shape from the header: 8 attention layers keep KV, 24 Gated DeltaNet layers keep state.
    assert out["shape"] == {"layers": 8, "kv_heads": 4, "head_dim": 256, "dtype": "float16"}
    assert out["kv_bytes_per_token"] == 2 * 8 * 4 * 256 * 2
    assert out["hybrid"]["state_bytes_per_sequence"] == 24 * (3 * QKV * 2 + V_HEADS * K_DIM * V_DIM * 4)
    assert main(["plan", "--model", str(nine_b)]) == 0
    with capsys.disabled():
        print("\n" + capsys.readouterr().out)


def test_without_the_mtp_head_the_same_weights_are_held(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # convert_hf_to_gguf.py --no-mtp (and the converters before MTP export): 32 blocks. use_more_bits(i, 32)
    # picks the same 16 layers as use_more_bits(i, 33) does among 0..31, so every held tensor has the same type.
    tensors = qwen35_9b_q4_k_m(LAYERS)
    assert tensors == [t for t in qwen35_9b_q4_k_m() if not t[0].startswith(f"blk.{LAYERS}.")]
    metadata = {k: v for k, v in METADATA.items() if k != "qwen35.nextn_predict_layers"}
    metadata |= {
        "qwen35.block_count": LAYERS,
        "qwen35.attention.recurrent_layers": [is_linear(b) for b in range(LAYERS)],
    }
    path = write_header_only_gguf(tmp_path / "no-mtp.gguf", "qwen35", metadata, tensors)
    weights = plan_json(capsys, "--model", str(path))["gguf_weights"]
    assert weights["held_bytes"] == held_here(tensors) == 5_720_876_032
    assert weights["file_tensor_bytes"] == weights["held_file_bytes"] == 5_618_141_184
    assert weights["skipped"]["tensors"] == 0


def test_agents_that_fit_on_16_gib(nine_b: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(nine_b), "--vram", "16GiB", "--context", "8192", "--prefix-tokens", "2000"]
    out = plan_json(capsys, *argv)
    fit = out["fit"]
    assert (fit["weights_source"], fit["weight_format"]) == ("gguf", "gguf")
    assert fit["weights_bytes"] == held_here(qwen35_9b_q4_k_m())
    # The same budget built here: the planner's reserve (vocab 248,320 from token_embd, 262,144 positions).
    reserve = fit["runtime_reserve"]
    assert (reserve["vocab_size"], reserve["rotary_positions"], reserve["head_dim"]) == (
        VOCAB,
        CONTEXT,
        HEAD_DIM,
    )
    budget = VramBudget(16 * GIB, held_here(qwen35_9b_q4_k_m()), 8192, 16, reserve["total_bytes"])
    state = RecurrentState(24, CONV, K_HEADS, V_HEADS, K_DIM, V_DIM, "float16", "float32")
    expected = fit_agents(KVShape(32, 8, KV_HEADS, HEAD_DIM, "float16", state), budget, 2000)
    assert fit["kv_budget_bytes"] == budget.kv_budget_bytes
    assert (fit["agents_fit_per_slot"], fit["agents_fit_shared"]) == (
        expected.agents_fit_per_slot,
        [expected.agents_fit_shared],
    )
    assert (expected.agents_fit_per_slot, expected.agents_fit_shared) == (PER_SLOT, SHARED)
    assert main(["plan", *argv]) == 0
    with capsys.disabled():
        print("\n" + capsys.readouterr().out)


PER_SLOT, SHARED = 31, 38
