"""bench/speculation_hybrid.py: a quick measure on a tiny float64 Qwen3.5 hybrid (structure, greedy identity on
against off, drafts accepted on the copy workload; no timing is asserted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from swarmkv.models.loader import load_model
from tiny_models import make_tiny_checkpoint

BENCH = Path(__file__).resolve().parents[1] / "bench" / "speculation_hybrid.py"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def load_bench() -> ModuleType:
    """bench/speculation_hybrid.py as a module (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_speculation_hybrid", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_quick_measure_on_a_tiny_hybrid(tmp_path: Path) -> None:
    bench = load_bench()
    make_tiny_checkpoint(tmp_path, "qwen3_5", vocab_size=64)
    loaded = load_model(tmp_path, dtype="float64")
    engines = bench.make_engines(loaded, kv_cache_memory="8MiB")
    results = bench.measure(engines, prompt_tokens=40, max_tokens=12, repeats=2, vocab=64)
    assert set(results) == set(bench.WORKLOADS)
    for name, r in results.items():
        assert r["identical"], name
        assert r["generated"] == 12 and r["repeats"] == 2
        assert set(r["decode_tok_s"]) == {"off", "on"} and r["decode_step_ms"] > 0
    copy = results["copy"]
    # The copy workload continues its sibling's reply: every draft is accepted, a step yields several tokens.
    assert copy["counters"]["spec_accepted_tokens"] == copy["counters"]["spec_draft_tokens"] > 0
    assert copy["tokens_per_verify_step"] > 2 and copy["verify_over_decode_step"] is not None
    assert copy["steps"]["on"] < copy["steps"]["off"]
