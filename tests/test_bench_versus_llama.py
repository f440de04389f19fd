"""bench/versus_llama.py: the bytes a decode step reads from a file (the MTP block and an untied embedding left
out), the per-layer difference, and a run on a tiny Qwen3.5 GGUF without llama.cpp (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from tiny_gguf import write_tiny_gguf

BENCH = Path(__file__).resolve().parents[1] / "bench"


@cache
def load_bench() -> ModuleType:
    """bench/versus_llama.py as a module (it imports bench/decode.py as its sibling)."""
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("bench_versus_llama", BENCH / "versus_llama.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_decoded_bytes_leave_out_an_untied_embedding(tmp_path: Path) -> None:
    bench = load_bench()
    tied = write_tiny_gguf(tmp_path / "tied.gguf", "qwen35", projections=Q.Q8_0)
    untied = write_tiny_gguf(tmp_path / "untied.gguf", "qwen35", projections=Q.Q8_0, tied=False)
    for path, counted in ((tied, True), (untied, False)):
        tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
        nbytes, layers = bench.decoded_bytes(path)
        assert layers == 3
        assert nbytes == sum(tensors.values()) - (0 if counted else tensors["token_embd.weight"])


def test_per_layer_is_the_difference_over_the_layers() -> None:
    bench = load_bench()

    def result(layers: int, ours: float, theirs: float) -> dict[str, object]:
        return {
            "layers": layers,
            "swarmkv": {"decode": {"median": ours}},
            "llama.cpp": {"tg": {"median": theirs}},
        }

    out = bench.per_layer([result(4, 100.0, 50.0), result(8, 50.0, 40.0)])
    assert abs(out["swarmkv"] - (20.0 - 10.0) / 4) < 1e-9
    assert abs(out["llama.cpp"] - (25.0 - 20.0) / 4) < 1e-9
    assert abs(out["ratio"] - 2.0) < 1e-9
    assert bench.per_layer([result(4, 1.0, 1.0)]) is None


def test_a_run_without_llama_cpp_reports_swarmkv_alone(tmp_path: Path) -> None:
    bench = load_bench()
    path = write_tiny_gguf(tmp_path / "q35.gguf", "qwen35", projections=Q.Q4_K)
    out = tmp_path / "out.json"
    assert (
        bench.main(
            [
                "--model",
                str(path),
                "--repeats",
                "1",
                "--batch",
                "2",
                "--threads",
                "1",
                "--prefill-tokens",
                "256",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    record = json.loads(out.read_text())
    (file,) = record["files"]
    assert file["c_decode_step"] and file["kv_dtype"] == "torch.float16"
    assert all(file["swarmkv"][k]["median"] > 0 for k in ("prefill", "decode", "batch2"))
    assert file["llama.cpp"] == {} and file["ratios"]["decode_vs_tg"] is None
    assert record["copy_gb_s"] > 0 and record["read_gb_s"] > 0
