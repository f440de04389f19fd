"""bench/gemv_rows.py: the line it fits to a kernel's time over its row counts (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_the_fit_splits_a_kernels_time_into_its_shared_and_per_row_parts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))  # it imports bench/decode.py as `decode`, as when run from bench/
    spec = importlib.util.spec_from_file_location("bench_gemv_rows", BENCH / "gemv_rows.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    shared, per_row = module.line_fit([1, 2, 4, 8], [17.0 + 3.2 * m for m in (1, 2, 4, 8)])
    assert shared == pytest.approx(17.0) and per_row == pytest.approx(3.2)
    shared, per_row = module.line_fit([1, 8], [20.0, 41.0])
    assert shared == pytest.approx(17.0) and per_row == pytest.approx(3.0)
    with pytest.raises(AssertionError, match="two distinct row counts"):
        module.line_fit([4, 4], [20.0, 21.0])
