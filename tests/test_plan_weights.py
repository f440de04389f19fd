"""`swarmkv plan` sizes the weights from the model's shape: the document's 9B on a 16 GiB card, the formula
against the model built on the meta device, and the user errors (the embedded GGUF: tests/test_plan.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from swarmkv.cli import main
from swarmkv.config import ModelConfig
from swarmkv.plan import Precision, check_weights, count_weights

GIB, MIB = 1024**3, 1024**2
NINE_B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "num_hidden_layers": 40,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}
NINE_B_FLAGS = [
    *("--layers", "40", "--kv-heads", "8", "--head-dim", "128", "--heads", "32", "--hidden-size", "4096"),
    *("--intermediate-size", "12288", "--vocab-size", "151936", "--qk-norm"),
]


def write_config(tmp_path: Path, **overrides: Any) -> Path:
    """A checkpoint directory holding only config.json: the planner needs no weights."""
    (tmp_path / "config.json").write_text(json.dumps({**NINE_B, **overrides}))
    return tmp_path


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    """`swarmkv plan ARGV --json` through the console script's main; its one JSON object."""
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def int4_bytes(out_features: int, in_features: int) -> int:
    """Half a byte per weight, plus a float16 scale and minimum per group of 32."""
    return out_features * in_features // 2 + 2 * out_features * (in_features // 32) * 2


def test_document_9b_int4_fits_8_agents_shared_on_16_gib(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(write_config(tmp_path))
    argv = ["--model", model, "--weight-format", "int4", "--vram", "16GiB"]
    argv += ["--agents", "8", "--context", "8192"]
    fit = run_json(capsys, *argv)["fit"]
    layer = (
        int4_bytes(6144, 4096) + int4_bytes(4096, 4096) + int4_bytes(24576, 4096) + int4_bytes(4096, 12288)
    )
    norms = (40 * (2 * 4096 + 2 * 128) + 4096) * 2
    embedding = 151936 * 4096 * 2
    assert fit["weight_format"] == "int4" and fit["weights_source"] == "config"
    assert fit["weights_bytes"] == 40 * layer + norms + 2 * embedding == 7_313_453_056
    assert 4.1 * GIB < fit["weights_bytes"] < 7.0 * GIB
    reserve = fit["runtime_reserve"]
    assert reserve["activation_bytes"] == 2048 * (4096 + 6144 + 2 * 12288) * 2 * 2
    assert reserve["logits_bytes"] == 151936 * 64 * 4
    assert reserve["rotary_bytes"] == 2 * 40960 * 128 * 4
    assert reserve["workspace_bytes"] == 512 * MIB
    assert (
        fit["runtime_reserve_bytes"]
        == reserve["total_bytes"]
        == sum(reserve[k] for k in ("activation_bytes", "logits_bytes", "rotary_bytes", "workspace_bytes"))
    )
    assert fit["kv_budget_bytes"] == 16 * GIB - fit["weights_bytes"] - fit["runtime_reserve_bytes"]
    assert (fit["kv_dtype"], fit["kv_bytes_per_token"]) == ("float16", 163_840)
    # 8,192 tokens are 1.25 GiB of KV per agent: 6 fit per-slot in the 8.35 GiB left. Sharing the
    # document's 2,000-token prefix, 8 fit; a 1,000-token prefix leaves room for 7.
    assert fit["agents_fit_per_slot"] == 6
    shared = dict(zip(fit["prefix_tokens"], fit["agents_fit_shared"], strict=True))
    assert shared == {1000: 7, 2000: 8, 3000: 9, 4000: 12}
    assert shared[2000] >= 8 > fit["agents_fit_per_slot"]

    assert main(["plan", *argv]) == 0
    text = capsys.readouterr().out
    assert "  weights           6.81 GiB  at int4, all but the projections in float16:" in text
    assert "    projections     4.49 GiB  int4 in groups of 32, a float16 scale and minimum per group" in text
    assert "    workspace      512.0 MiB  CUDA context" in text
    assert "  KV budget         8.35 GiB  what is left for KV pages" in text
    assert "Agents that fit: 6 per-slot" in text
    assert "        2,000                6              8" in text


def test_flags_count_the_same_weights_as_the_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from_config = run_json(
        capsys, "--model", str(write_config(tmp_path)), "--weight-format", "int4", "--vram", "16GiB"
    )
    from_flags = run_json(capsys, *NINE_B_FLAGS, "--weight-format", "int4", "--vram", "16GiB")
    assert from_flags["fit"]["weights"] == from_config["fit"]["weights"]
    # The flags know no position limit: the rotary table covers the planned context.
    assert from_flags["fit"]["runtime_reserve"]["rotary_positions"] == 8192


def test_auto_follows_the_checkpoint_and_kv_dtype_follows_the_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = str(write_config(tmp_path))
    fit = run_json(capsys, "--model", model, "--vram", "40GiB")["fit"]
    assert (fit["weight_format"], fit["weights"]["dtype"], fit["kv_dtype"]) == (
        "bfloat16",
        "bfloat16",
        "bfloat16",
    )
    shapes = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # qkv, o, gate-up, down
    assert fit["weights"]["projections_bytes"] == 40 * sum(n * k * 2 for n, k in shapes)
    fit = run_json(capsys, "--model", model, "--weight-format", "float32", "--vram", "80GiB")["fit"]
    assert (fit["kv_dtype"], fit["kv_bytes_per_token"]) == ("float32", 2 * 163_840)
    fit = run_json(
        capsys, "--model", model, "--weight-format", "int8", "--kv-dtype", "fp8_e4m3", "--vram", "16GiB"
    )["fit"]
    assert (fit["weights"]["dtype"], fit["kv_dtype"], fit["kv_bytes_per_token"]) == (
        "float16",
        "fp8_e4m3",
        81_920,
    )
    # int8: one byte per weight and a float16 scale and minimum per group of 32.
    assert fit["weights"]["projections_bytes"] == 40 * sum(n * k + 2 * n * (k // 32) * 2 for n, k in shapes)


SMALL = ModelConfig(
    architecture="qwen3",
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=256,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=128,
    tie_word_embeddings=False,
    qk_norm=True,
)


@pytest.mark.parametrize("fmt", ["int4", "int8", "float16", "bfloat16", "float32"])
@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True}, {"attention_bias": True, "qk_norm": False, "architecture": "qwen2"}],
)
def test_formula_matches_the_model_built_on_meta(fmt: str, overrides: dict[str, Any]) -> None:
    config = ModelConfig(**{**SMALL.__dict__, **overrides})
    check = check_weights(config, Precision.resolve(fmt, "float16"))
    assert check.difference_bytes == 0 and check.agrees
    count = count_weights(config, Precision.resolve(fmt, "float16"))
    assert count.total_bytes == check.measured_bytes
    assert (count.lm_head_bytes == 0) == config.tie_word_embeddings
    assert (count.biases_bytes > 0) == config.attention_bias


@pytest.mark.parametrize("fmt", ["int4", "int8", "float16"])
def test_measure_reports_the_weights_check(
    fmt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}
    model = str(write_config(tmp_path, **small, head_dim=16, intermediate_size=96, vocab_size=256))
    out = run_json(capsys, "--model", model, "--weight-format", fmt, "--measure", "--prefix-tokens", "32")
    weights = out["measured"]["weights"]
    assert weights["weight_format"] == fmt and out["measured"]["agrees"]
    assert weights["measured_bytes"] == weights["formula_bytes"] > 0 and weights["difference_bytes"] == 0
    assert main(["plan", "--model", model, "--weight-format", fmt, "--measure", "--prefix-tokens", "32"]) == 0
    assert f"the model built at {fmt} on the meta device" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flag", "value", "choices"),
    [
        ("--weight-format", "int3", "'auto', 'int4', 'int8', 'float16', 'bfloat16', 'float32'"),
        ("--kv-dtype", "fp4", "'auto', 'float16', 'bfloat16', 'float32', 'fp8_e4m3'"),
    ],
)
def test_unknown_format_is_a_usage_error(
    flag: str, value: str, choices: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", *NINE_B_FLAGS, flag, value])
    assert exit_info.value.code == 2
    assert f"invalid choice: '{value}' (choose from {choices})" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("vram", "message"),
    [
        ("4GiB", "--vram 4.00 GiB is smaller than the weights (6.81 GiB) by 2.81 GiB (3,018,485,760 bytes)"),
        (
            "7GiB",
            "--vram 7.00 GiB holds the weights (6.81 GiB) but not the runtime reserve (0.84 GiB) besides",
        ),
    ],
)
def test_vram_too_small_says_by_how_much(
    vram: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["plan", "--model", str(write_config(tmp_path)), "--weight-format", "int4", "--vram", vram]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("swarmkv plan: error: ") and message in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            NINE_B_FLAGS[:10],
            "needs --hidden-size, --intermediate-size, --vocab-size, --heads (missing --intermediate-size, --vocab-size)",
        ),
        ([*NINE_B_FLAGS[:6], "--weight-format", "int4", "--vram", "16GiB"], "pass --weights SIZE"),
        ([*NINE_B_FLAGS[:6], "--qk-norm"], "missing --hidden-size"),
        (
            [*NINE_B_FLAGS, "--hidden-size", "4080", "--weight-format", "int4", "--vram", "16GiB"],
            "int4 weights need input sizes divisible by 32, got 4080",
        ),
        (
            [*NINE_B_FLAGS, "--hidden-size", "4080", "--weight-format", "int8", "--vram", "16GiB"],
            "int8 weights need input sizes divisible by 32, got 4080",
        ),
        ([*NINE_B_FLAGS, "--vocab-size", "0", "--vram", "16GiB"], "--vocab-size must be a positive integer"),
        (["--model", "x.gguf", "--qk-norm"], "not both (--qk-norm with --model)"),
        ([*NINE_B_FLAGS, "--vram", "40GiB", "--max-num-seqs", "0"], "--max-num-seqs must be positive"),
    ],
)
def test_bad_size_flags_are_user_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err
