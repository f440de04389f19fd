"""bench/structured.py at its --quick size's shape: the committed case set, and two cases through both runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import structured as bench  # noqa: E402


def test_the_full_set_has_at_least_200_prompts_of_both_kinds() -> None:
    cases = bench.make_cases(140, 70)
    assert len(cases) >= 200
    assert sum("tool" in c for c in cases) == 140 and sum("schema" in c for c in cases) == 70
    assert bench.make_cases(140, 70) == cases  # generated deterministically


@pytest.mark.model
@pytest.mark.slow
def test_constrained_cases_all_parse_and_validate() -> None:
    from swarmkv import LLM

    llm = LLM(kv_cache_memory="256MiB", max_model_len=8192)
    cases = bench.make_cases(1, 1)
    row = bench.run(llm, cases, constrained=True, batch=2, max_tokens=128)
    assert row["cut_by_max_tokens"] == 0 and row["valid_json"] == 1.0 and row["schema_valid"] == 1.0
