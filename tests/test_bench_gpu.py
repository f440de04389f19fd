"""bench/gpu.py end to end in its small CPU mode: every section measures, and none records an error."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "gpu.py"


@cache
def load_bench() -> ModuleType:
    """bench/gpu.py as a module (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def check_decode_point(p: dict[str, Any]) -> None:
    for key in ("step_ms", "limit_ms", "ratio_to_limit", "ratio_to_cascade_limit", "weight_bytes"):
        assert positive(p[key]), (key, p)
    # A step reads at most every row's whole context and at least what cascade would leave to read.
    assert 0 < p["kv_bytes_cascade"] <= p["kv_bytes_read"] <= p["kv_bytes_per_slot"]


@pytest.mark.slow  # about 11 s here
def test_small_cpu_run_measures_every_section(tmp_path: Path) -> None:
    gpu = load_bench()
    out = tmp_path / "gpu.json"
    assert gpu.main(["--device", "cpu", "--small", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    sections = record["sections"]
    assert list(sections) == list(gpu.SECTIONS)
    assert {name: s["error"] for name, s in sections.items() if "error" in s} == {}

    bandwidth = sections["bandwidth"]
    assert positive(bandwidth["measured_copy_bytes_per_s"]) and positive(bandwidth["peak_bytes_per_s"])

    small = gpu.SMALL
    points = sections["decode"]["points"]
    assert [(p["batch"], p["context_tokens"]) for p in points] == [
        (b, c) for b in small.decode_batches for c in small.decode_contexts
    ]
    for p in points:
        check_decode_point(p)

    assert positive(sections["prefill"]["tokens_per_s"])
    assert sections["prefill"]["prompt_tokens"] == small.prefill_tokens

    sharing = sections["sharing"]
    on, off, per_slot = sharing["shared_cascade_on"], sharing["shared_cascade_off"], sharing["per_slot"]
    for p in (on, off, per_slot):
        check_decode_point(p)
    # Cascade on groups every row over the shared head and reads it once; off and per-slot read it per row.
    assert on["cascade_rows_per_step"] == sharing["batch"]
    assert on["kv_bytes_read"] < off["kv_bytes_read"] == off["kv_bytes_per_slot"]
    assert off["cascade_rows_per_step"] == 0 and per_slot["cascade_rows_per_step"] == 0
    assert per_slot["prefix_caching"] is False
    assert per_slot["kv_bytes_cascade"] == per_slot["kv_bytes_per_slot"]  # no pages in common to group
    assert positive(sharing["per_slot_over_shared"]) and positive(sharing["cascade_off_over_on"])

    versus = sections["transformers"]
    assert positive(versus["swarmkv_s"]) and positive(versus["transformers_s"])
    assert positive(versus["transformers_over_swarmkv"])
    # float32 and the same weights: transformers' greedy tokens are ours (the weight mapping is right).
    assert versus["greedy_equal_rows"] == small.agents

    swarm = sections["swarm"]
    assert positive(swarm["shared"]["wall_s"]) and positive(swarm["per_slot"]["wall_s"])
    assert positive(swarm["shared_over_per_slot_wall"])
    assert swarm["shared"]["prefill_tokens_computed"] < swarm["per_slot"]["prefill_tokens_computed"]

    kernels = sections["kernels"]
    formats = {(p["format"], p["projection"], p["rows"]) for p in kernels["points"]}
    assert formats == {
        (fmt, proj, rows)
        for fmt in gpu.KERNEL_FORMATS
        for proj in ("qkv", "o_proj", "gate_up", "down_proj")
        for rows in small.kernel_rows
    }
    for p in kernels["points"]:
        assert positive(p["us"]) and positive(p["weight_bytes"]) and positive(p["fraction_of_copy_bandwidth"])
    # int4 holds half a byte a weight plus its groups' scales and minimums; int8 a byte plus its groups' (9 bits).
    by = {(p["format"], p["projection"]): p["weight_bytes"] for p in kernels["points"]}
    assert by[("int4", "qkv")] < by[("int8", "qkv")] < by[("float", "qkv")]
    assert by[("q4_k", "qkv")] < by[("q6_k", "qkv")] < by[("int8", "qkv")]  # 4.625 and 6.5625 bits a weight

    launches = sections["launches"]
    assert len(launches["per_layer"]) == small.num_layers and all(n > 0 for n in launches["per_layer"])
    assert launches["max_per_layer"] == max(launches["per_layer"]) <= launches["step_total"]

    hybrid = sections["hybrid"]
    for layout in ("shared", "per_slot"):
        check_decode_point(hybrid[layout])
        assert (
            hybrid[layout]["state_bytes_read_and_written"]
            == 2 * small.hybrid_batch * hybrid["state_bytes_per_sequence"]
        )
    assert hybrid["per_slot"]["prefix_caching"] is False and positive(hybrid["per_slot_over_shared"])

    assert len(record["targets"]) == 9
    for target in record["targets"]:
        assert isinstance(target["met"], bool)
        # the device's idle share comes from the GPU profiler only
        assert positive(target["ratio"]) or (target["ratio"] is None and "GPU only" in target["target"])


def test_a_failing_section_records_its_error_and_the_next_runs() -> None:
    gpu = load_bench()
    record: dict[str, Any] = {"sections": {}}
    failed = gpu.FailedSteps()
    cpu = torch.device("cpu")
    gpu.run_section(record, "raises", lambda: {"x": 1 / 0}, cpu, failed)

    def a_step_fails() -> dict[str, Any]:
        logging.getLogger("swarmkv.engine.engine").error("a step of 1 chunk(s) failed")
        return {"x": 1.0}

    logger = logging.getLogger("swarmkv")
    logger.addHandler(failed)
    try:
        gpu.run_section(record, "step fails", a_step_fails, cpu, failed)
        gpu.run_section(record, "fine", lambda: {"x": 1.0}, cpu, failed)
    finally:
        logger.removeHandler(failed)
    sections = record["sections"]
    assert sections["raises"]["error"].startswith("ZeroDivisionError")
    assert "the engine logged 1 error(s)" in sections["step fails"]["error"]
    assert "error" not in sections["fine"] and sections["fine"]["x"] == 1.0


@pytest.mark.slow  # about 12 s here
def test_bench_gpu_runs_with_int4_weights(tmp_path: Path) -> None:
    gpu = load_bench()
    # Every section the model's weights reach: the kernels section times each format's projections alone
    # whatever --weights says (the float run above covers it), and took some 40% of this run.
    sections = [name for name in gpu.SECTIONS if name != "kernels"]
    out = tmp_path / "int4.json"
    assert (
        gpu.main(["--device", "cpu", "--weights", "int4", "--sections", *sections, "--json", str(out)]) == 0
    )
    record = json.loads(out.read_text())
    assert "int4" in record["config"]["model"]
    assert list(record["sections"]) == sections
    assert all("error" not in section for section in record["sections"].values())
