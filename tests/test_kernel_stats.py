"""The compiled kernels' resource use, read by bench/kernel_stats.py for sm_90 and gfx1201 without a GPU: the
int4/int8 matmuls and GGUF's grouped one (one GEMV kernel, at decode and prefill tiles) and the attention kernels
spill nothing, and the GEMV kernel's weight loads are at least 8 bytes a lane."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"sm_90": "nvidia", "gfx1201": "amd"}  # target -> the triton backend that compiles for it
WEIGHT_LOAD = "packed = tl.load(w_ptrs"  # the source line of the GEMV's weight load (kernels/quant_gemv.py)


def _backends() -> set[str]:
    """The triton backends installed here (each compiles for its vendor's targets)."""
    return set(pytest.importorskip("triton.backends").backends)


def _stats(tmp_path: Path, cases: list[str], configs: list[str] | None = None) -> list[dict[str, Any]]:
    """bench/kernel_stats.py's JSON records for `cases` on the targets whose backend this triton has."""
    targets = [t for t, backend in TARGETS.items() if backend in _backends()]
    if len(targets) < len(TARGETS):
        pytest.skip(f"triton lacks the backend for {sorted(set(TARGETS) - set(targets))}")
    out = tmp_path / "stats.json"
    # Compiling needs real JIT functions: the test session's interpreter setting must not reach the script.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(ROOT / "bench" / "kernel_stats.py"), "--json", str(out), "--cases", *cases]
    cmd += ["--targets", *targets, *(["--configs", *configs] if configs else [])]
    subprocess.run(cmd, check=True, env=env, capture_output=True, timeout=600)
    records: list[dict[str, Any]] = json.loads(out.read_text())["kernels"]
    return records


def _spills(records: list[dict[str, Any]]) -> list[str]:
    return [
        f"{r['kernel']} {r['config']} {r['target']}: {r['spilled_bytes']} spilled, {r['scratch_bytes']} B scratch"
        for r in records
        if r["spilled_bytes"] or r["scratch_bytes"]
    ]


@pytest.fixture(scope="module")
def matmul_and_attention_records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """The int4, int8 and attention cases' records by case, from one run of the script (each run starts torch
    and triton afresh)."""
    records = _stats(tmp_path_factory.mktemp("kernel_stats"), ["int4", "int8", "attention"])
    by_case: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_case.setdefault(r["case"], []).append(r)
    return by_case


def test_quantized_matmuls_spill_nothing_and_load_weights_wide(
    matmul_and_attention_records: dict[str, list[dict[str, Any]]],
) -> None:
    records = matmul_and_attention_records.get("int4", []) + matmul_and_attention_records.get("int8", [])
    gemv = [r for r in records if r["kernel"] == "_quant_gemv_kernel"]
    # int4 and int8 at decode (M = 1, 8, 32) and prefill, each on both targets
    assert len(gemv) == 2 * 4 * len(TARGETS), [(r["kernel"], r["config"], r["target"]) for r in records]
    assert not _spills(records), _spills(records)
    for r in gemv:
        weight = [s for s in r["loads"] if s["source"].startswith(WEIGHT_LOAD)]
        assert weight, (r["config"], r["target"], r["loads"])
        assert min(s["min_bytes"] for s in weight) >= 8, (r["config"], r["target"], weight)


def test_gguf_layouts_share_the_gemv_spill_nothing_and_load_weights_wide(tmp_path: Path) -> None:
    records = _stats(tmp_path, ["gguf"], ["Q4_K", "Q6_K"])
    gemv = [r for r in records if r["kernel"] == "_quant_gemv_kernel"]
    # Q4_K and Q6_K (two-level constants; Q6_K's high plane) at decode (M = 1, 8, 32) and prefill, on both targets
    assert len(gemv) == 2 * 4 * len(TARGETS), [(r["kernel"], r["config"], r["target"]) for r in records]
    assert not _spills(records), _spills(records)
    for r in gemv:
        weight = [s for s in r["loads"] if s["source"].startswith(WEIGHT_LOAD)]
        assert weight, (r["config"], r["target"], r["loads"])
        assert min(s["min_bytes"] for s in weight) >= 8, (r["config"], r["target"], weight)


def test_a_cached_kernel_naming_a_gone_checkout_reads_this_checkouts_source() -> None:
    """Triton's cache keys a compile by its source, not its path: the line info of a kernel compiled in a clone
    since deleted still names that clone's file, and the weight load must be found in this checkout's."""
    pytest.importorskip("triton")
    lines = (ROOT / "src" / "swarmkv" / "kernels" / "quant_gemv.py").read_text().splitlines()
    number = next(i for i, text in enumerate(lines, 1) if text.strip().startswith(WEIGHT_LOAD))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT / 'bench')!r}); import kernel_stats; "
        f"print(kernel_stats.source_line('/gone/clone/src/swarmkv/kernels/quant_gemv.py', {number}))"
    )
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(WEIGHT_LOAD)


def test_attention_kernels_spill_nothing(
    matmul_and_attention_records: dict[str, list[dict[str, Any]]],
) -> None:
    records = matmul_and_attention_records.get("attention", [])
    kernels = {r["kernel"] for r in records}
    assert {"_attention_kernel", "_merge_kernel", "_store_kv_kernel"} <= kernels
    assert not _spills(records), _spills(records)
