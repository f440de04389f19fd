"""bench/kquant_gemv.py runs every shape, scaled down, with both activations (no timing is asserted)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from swarmkv.kernels import cpu_grouped

BENCH = Path(__file__).resolve().parents[1] / "bench" / "kquant_gemv.py"


@pytest.mark.skipif(not cpu_grouped.has_int8_dot(), reason="no int8 kernel on this machine")
def test_every_shape_prints_a_row(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("bench_kquant_gemv", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--scale", "0.01", "--repeats", "1", "--rows", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines()[1:] if line.strip()]
    assert [line.split()[0] for line in rows] == [kind.name for kind, _, _ in module.SHAPES]
    assert all(line.count("GB/s") == 2 for line in rows)
