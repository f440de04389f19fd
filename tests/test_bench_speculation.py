"""bench/speculation.py: its prompt set, and a quick measure on a tiny float32 model (structure and greedy
identity on against off; no timing is asserted)."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

from gguf import GGMLQuantizationType as Q

from conftest_tokenizer_helpers import qwen_tokenizer
from swarmkv.models.loader import load_model
from tiny_gguf import write_tiny_gguf

BENCH = Path(__file__).resolve().parents[1] / "bench" / "speculation.py"


@cache
def load_bench() -> ModuleType:
    """bench/speculation.py as a module (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_speculation", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_prompt_set_has_every_workload() -> None:
    bench = load_bench()
    prompts = bench.load_prompts()
    assert set(prompts) == set(bench.WORKLOADS)
    swarms = ("swarm", bench.STAGGERED)
    assert len(prompts["swarm"]) == 8 and all(len(p) == 1 for k, p in prompts.items() if k not in swarms)
    assert prompts[bench.STAGGERED] == prompts["swarm"]  # the same agents, arriving apart
    heads = {p[0]["content"] for p in prompts["swarm"]}
    assert len(heads) == 1  # one system prompt: one head
    assert "`foo`" in prompts["file_edit"][0][-1]["content"]
    grammars = bench.load_grammars(qwen_tokenizer())  # the swarm's calls are forced: tool_choice required
    assert grammars["swarm"] is not None and grammars[bench.STAGGERED] == grammars["swarm"]
    assert all(grammars[name] is None for name in ("file_edit", "tool_call", "prose"))


def test_quick_measure_on_a_tiny_float_model(tmp_path: Path) -> None:
    """Token-id prompts stand in for the chat prompts (the tiny model's vocabulary is its own); a repeated
    prompt gives the drafter something to match."""
    bench = load_bench()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", projections=Q.F32)
    loaded = load_model(path, dtype="float32", weights="float")
    llms = bench.make_llms(loaded, 16, no_siblings=True, kv_cache_memory="16MiB")
    assert llms[bench.NO_SIBLINGS].engine.config.draft_sources == ("own", "session")
    base = [5, 6, 7, 8, 9, 10, 11, 12] * 6
    prompts = {
        "file_edit": [base],
        "tool_call": [base[:20]],
        "swarm": [base + [20 + i] for i in range(8)],
        bench.STAGGERED: [base + [20 + i] for i in range(8)],
        "prose": [[30, 31, 32]],
    }
    results = bench.measure(llms, prompts, list(bench.WORKLOADS), 16, 2)
    assert set(results) == set(bench.WORKLOADS)
    for name, r in results.items():
        assert r["identical"], name
        assert r["rows"] == len(prompts[name])
        assert set(r["decode_tok_s"]) == {"off", "on"}
        assert len(r["samples"]["on"]["long_s"]) == 2
    assert results["file_edit"]["counters"]["spec_accepted_tokens"] > 0  # identity was checked with drafts
    staggered = results[bench.STAGGERED]
    assert staggered["accepted_no_siblings"] is not None and results["swarm"]["accepted_no_siblings"] is None
    assert staggered["counters"]["spec_accepted_sibling_tokens"] > 0  # siblings lent drafts with every source
    alone = bench.run_once(llms[bench.NO_SIBLINGS], prompts[bench.STAGGERED], 16, 3)
    assert alone.counters["spec_accepted_tokens"] > 0 and alone.counters["spec_accepted_sibling_tokens"] == 0
    assert bench.identity_check(llms, prompts, ["swarm"], 16) == {"swarm": True}
    assert bench.identity_check(llms, prompts, [bench.STAGGERED], 16, 3) == {bench.STAGGERED: True}

    lines = bench.report(results, {"swarm": True})
    assert any(line.startswith(("PASS", "FAIL", "-")) and "file_edit" in line for line in lines)
    assert any("siblings add" in line for line in lines)


def test_staggered_arrivals_add_each_agent_after_its_steps(tmp_path: Path) -> None:
    """Agent i joins after i x stagger_steps engine steps: the first runs alone for its first steps, then the
    others join it one by one."""
    bench = load_bench()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", projections=Q.F32)
    loaded = load_model(path, dtype="float32", weights="float")
    llm = bench.make_llms(loaded, 12, kv_cache_memory="16MiB")["off"]
    seen: list[int] = []
    step = llm.engine.step

    def counting_step() -> list:  # type: ignore[type-arg]
        scheduler = llm.engine.core.scheduler
        seen.append(len(scheduler.waiting) + len(scheduler.running))
        return step()

    llm.engine.step = counting_step  # type: ignore[method-assign]
    prompts = [[5, 6, 7, 8 + i] for i in range(3)]
    run = bench.run_once(llm, prompts, 12, stagger_steps=4)  # type: ignore[arg-type]
    assert [len(t) for t in run.token_ids] == [12, 12, 12]
    assert seen[:4] == [1, 1, 1, 1] and seen[4] == 2 and max(seen) == 3
