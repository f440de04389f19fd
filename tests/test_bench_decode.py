"""bench/decode.py: its helpers' arithmetic, its reading of llama-bench's JSON, and a quick run on a tiny GGUF
that measures every figure (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
import stat
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from gguf import GGMLQuantizationType as Q

from swarmkv import LLM, SamplingParams
from swarmkv.models.loader import load_model
from tiny_gguf import write_tiny_gguf

BENCH = Path(__file__).resolve().parents[1] / "bench" / "decode.py"


def llama_record(n_prompt: int, n_gen: int, samples_ts: list[float]) -> dict[str, Any]:
    """One test of llama-bench's `-o json`, cut to the fields the bench reads and a few it does not."""
    return {
        "build_commit": "0c1e570",
        "model_type": "llama 256M Q4_1",
        "n_threads": 2,
        "n_prompt": n_prompt,
        "n_gen": n_gen,
        "n_depth": 0,
        "avg_ns": 237767277,
        "avg_ts": sum(samples_ts) / len(samples_ts),
        "stddev_ts": 1.0,
        "samples_ts": samples_ts,
    }


def llama_json(n_prompt: int = 512, n_gen: int = 128) -> str:
    """What `llama-bench -p n_prompt -n n_gen -o json` prints, plus a combined test (`-pg`)."""
    records = [
        llama_record(n_prompt, 0, [330.0, 341.0, 320.0]),
        llama_record(0, n_gen, [150.0, 153.0]),
        llama_record(n_prompt, n_gen, [100.0]),
    ]
    return json.dumps(records, indent=2)


@cache
def load_bench() -> ModuleType:
    """bench/decode.py as a module (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_decode", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_llama_bench_json_is_read_per_test_at_its_best_repetition() -> None:
    tests = load_bench().parse_llama_bench(llama_json())
    assert set(tests) == {"pp512", "tg128", "pp512+tg128"}
    assert tests["pp512"]["best_tok_s"] == 341.0
    assert tests["pp512"]["avg_tok_s"] == pytest.approx(991.0 / 3)
    assert tests["tg128"]["best_tok_s"] == 153.0
    # A record without samples (older builds) falls back to its mean.
    old = load_bench().parse_llama_bench(json.dumps([{"n_prompt": 0, "n_gen": 64, "avg_ts": 12.5}]))
    assert old == {"tg64": {"best_tok_s": 12.5, "avg_tok_s": 12.5}}


def test_decode_rate_is_the_extra_tokens_over_the_extra_time() -> None:
    bench = load_bench()
    # 8 rows x 64 tokens in the 2 s the longer run took beyond the 1-token one.
    assert bench.decode_tok_s(8, 64, 2.5, 0.5) == pytest.approx(256.0)
    assert bench.decode_tok_s(1, 64, 0.5, 0.5) is None  # noise: the longer run was no slower
    assert bench.ratio(3.0, 1.5) == 2.0
    assert bench.ratio(None, 1.0) is None and bench.ratio(1.0, None) is None and bench.ratio(1.0, 0.0) is None
    assert bench.times(None) == "-" and bench.times(1.234) == "1.23x"


def test_targets_compare_against_llama_bench_and_batch_1() -> None:
    bench = load_bench()
    record: dict[str, Any] = {
        "formats": {
            "gguf": {
                "prefill_tok_s": 600.0,
                "batches": {1: {"generate_tok_s": 40.0, "vs_batch1": 1.0}, 8: {"vs_batch1": 4.5}},
            }
        }
    }
    llama = {"tests": bench.parse_llama_bench(llama_json())}
    bench.compare_llama(record, llama, 512, 128)
    assert llama["versus"]["gguf"]["decode_over_tg"] == pytest.approx(40.0 / 153.0)
    assert llama["versus"]["gguf"]["prefill_over_pp"] == pytest.approx(600.0 / 341.0)
    record["llama_bench"] = llama
    met = {t["what"]: t["met"] for t in bench.targets(record, 128, 512)}
    assert met == {
        "gguf: decode at batch 8 against batch 1": True,
        "gguf: one request's decode against llama.cpp tg128": False,
        "gguf: prefill 512 against llama.cpp pp512": True,
    }


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("decode") / "tiny.gguf", projections=Q.Q8_0)


def test_bare_loop_tokens_are_the_engines(tiny_gguf: Path) -> None:
    """The bare loop drives the engine's model over its KV cache: float32 greedy tokens equal generate's."""
    bench = load_bench()
    loaded = load_model(tiny_gguf, dtype="float32", weights="float")
    llm = LLM(loaded=loaded, prefix_caching=False, kv_cache_memory="16MiB")
    prompts = bench.distinct_prompts(3, 20, loaded.config.vocab_size, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate(prompts, params)]
    seconds, tokens = bench.bare_decode(loaded, llm.engine.runner.kv_cache, prompts, 5)
    assert seconds > 0
    assert tokens == expected


@pytest.mark.slow  # about 15 s here: it loads transformers too
def test_quick_run_measures_every_figure(tiny_gguf: Path, tmp_path: Path) -> None:
    """--quick on the tiny file, with a stand-in llama-bench that prints canned JSON for quick's sizes."""
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!/bin/sh\ncat <<'EOF'\n{llama_json(64, 16)}\nEOF\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    batched = tmp_path / "llama-batched-bench"  # beside llama-bench: one jsonl line a batch, among its log
    lines = [json.dumps({"pl": b, "pp": 16, "tg": 8, "speed_tg": 100.0 * b**0.5}) for b in (1, 2)]
    batched.write_text("#!/bin/sh\necho 'main: log line'\n" + "".join(f"echo '{line}'\n" for line in lines))
    batched.chmod(batched.stat().st_mode | stat.S_IXUSR)
    out = tmp_path / "decode.json"
    argv = ["--quick", "--model", str(tiny_gguf), "--weights", "gguf", "float"]
    argv += ["--llama-bench", str(fake), "--json", str(out)]
    assert load_bench().main(argv) == 0
    record = json.loads(out.read_text())
    assert list(record["formats"]) == ["gguf", "float"]
    for figures in record["formats"].values():
        assert figures["prefill_tok_s"] > 0
        assert list(figures["batches"]) == ["1", "2"]
        for row in figures["batches"].values():
            assert row["bare_tok_s"] > 0 and row["bare_vs_batch1"] > 0
        assert figures["batches"]["1"]["transformers_tok_s"] > 0
    assert record["transformers"]["1"]["decode_tok_s"] > 0
    llama = record["llama_bench"]
    assert llama["command"][-8:] == ["-p", "64", "-n", "16", "-o", "json", "-r", "1"]
    assert llama["versus"]["gguf"]["prefill_over_pp"] == pytest.approx(
        record["formats"]["gguf"]["prefill_tok_s"] / 341.0
    )
    # The decode ratio is missing only where noise left the batch-1 figure out.
    decode = record["formats"]["gguf"]["batches"]["1"]["generate_tok_s"]
    assert llama["versus"]["gguf"]["decode_over_tg"] == (
        None if decode is None else pytest.approx(decode / 153.0)
    )
    assert len(record["targets"]) == 4  # per format: tg and pp (no batch 8 in a quick run)
    theirs = record["llama_batched"]
    assert theirs["command"][-8:] == ["-npp", "16", "-ntg", "8", "-npl", "1,2", "--output-format", "jsonl"]
    assert theirs["decode_tok_s"] == {"1": 100.0, "2": pytest.approx(141.42, rel=1e-3)}
    assert theirs["vs_batch1"]["2"] == pytest.approx(1.4142, rel=1e-3)
    ours = record["formats"]["gguf"]["batches"]["2"]["generate_tok_s"]
    assert theirs["versus"]["gguf"]["2"] == (None if ours is None else pytest.approx(ours / 141.42, rel=1e-3))


def test_a_failing_llama_cpp_tool_raises_with_its_command_and_stderr(tmp_path: Path) -> None:
    fake = tmp_path / "llama-batched-bench"
    fake.write_text("#!/bin/sh\necho 'error: unknown argument: --output-format' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(RuntimeError, match="exited 1: error: unknown argument"):
        load_bench().run_batched_bench(fake, tmp_path / "m.gguf", 2, 16, 8, [1, 2])
