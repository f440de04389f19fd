"""bench/layout_quality.py: its cases, its validator, its paired statistics, and a run on a handful of cases."""

from __future__ import annotations

import importlib.util
import math
import random
import sys
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from swarmkv import LLM
from swarmkv.tokenizer import Tokenizer

BENCH = Path(__file__).resolve().parents[1] / "bench"


@cache
def load(name: str) -> ModuleType:
    """A bench/ script as a module (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


def test_cases_are_the_same_for_a_seed_and_differ_across_seeds() -> None:
    cases = load("layout_cases")
    a, b = cases.make_cases(40, seed=3), cases.make_cases(40, seed=3)
    assert [c.messages() for c in a] == [c.messages() for c in b]
    assert [c.user for c in a] != [c.user for c in cases.make_cases(40, seed=4)]
    for case in a:
        names = [t["function"]["name"] for t in case.tools]
        assert 3 <= len(names) <= 5 and case.expected in names
        earlier_call = case.earlier[1]["tool_calls"][0]["function"]
        assert (
            earlier_call["name"] in names and earlier_call["name"] != case.expected
        )  # copying is never right
    assert len({c.agent for c in a}) == 5  # 8 requests to an agent


def test_every_scripted_right_call_is_valid_and_the_validator_refuses_what_the_schema_refuses() -> None:
    cases = load("layout_cases")
    rng = random.Random(0)
    for tool, requests in cases.REQUESTS.items():
        schema = cases.TOOLS[tool]["function"]["parameters"]
        for _, arguments in requests:
            fills = cases._fills(rng)
            filled = {k: v.format(**fills) if isinstance(v, str) else v for k, v in arguments.items()}
            assert cases.schema_errors(filled, schema) == [], (tool, filled)
    read = cases.TOOLS["read_file"]["function"]["parameters"]
    weather = cases.TOOLS["get_weather"]["function"]["parameters"]
    issue = cases.TOOLS["create_issue"]["function"]["parameters"]
    assert cases.schema_errors({"path": "a", "offset": 3}, read) == []
    refused = [
        ({}, read),  # missing the required key
        ({"path": 7}, read),  # wrong type
        ({"path": "a", "offset": 0}, read),  # under the minimum
        ({"path": "a", "offset": True}, read),  # a boolean is not an integer
        ({"path": "a", "type": "string"}, read),  # not in the schema, which allows no others
        ({"city": "Oslo", "unit": "kelvin"}, weather),  # not in the enum
        ({"title": "t", "labels": ["bug", 3]}, issue),  # an array item of the wrong type
        (["path"], read),  # not an object
    ]
    for value, schema in refused:
        assert cases.schema_errors(value, schema), value


def test_the_validator_agrees_with_jsonschema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    cases = load("layout_cases")
    values: list[Any] = [
        {},
        {"path": "a"},
        {"path": "a", "offset": 0},
        {"path": "a", "limit": 2.0},
        {"path": "a", "recursive": 1},
        {"city": "Oslo", "unit": "celsius"},
        {"city": "Oslo", "unit": "kelvin"},
        {"title": "t", "labels": ["a"]},
        {"title": "t", "labels": "a"},
        {"command": "ls", "timeout_s": 601},
        {"message": "m", "all": False, "extra": 1},
        {"expression": None},
    ]
    for tool in cases.TOOLS.values():
        schema = tool["function"]["parameters"]
        for value in values:
            ours = not cases.schema_errors(value, schema)
            theirs = jsonschema.Draft202012Validator(schema).is_valid(value)
            assert ours == theirs, (tool["function"]["name"], value)


def test_paired_statistics() -> None:
    bench = load("layout_quality")
    template = [True] * 30 + [True] * 5 + [False] * 15 + [False] * 50
    tools_first = [True] * 30 + [False] * 5 + [True] * 15 + [False] * 50
    t = bench.pair(template, tools_first)
    assert (t.n, t.both, t.template_only, t.tools_first_only, t.neither) == (100, 30, 5, 15, 50)
    assert (t.template_rate, t.tools_first_rate, t.difference) == (0.35, 0.45, pytest.approx(0.10))
    # McNemar's exact p: the discordant cases as fair coin flips.
    assert bench.mcnemar_exact_p(t) == pytest.approx(2 * sum(math.comb(20, i) for i in range(6)) / 2**20)
    assert bench.mcnemar_exact_p(bench.pair([True, True], [False, False])) == 0.5
    assert bench.mcnemar_exact_p(bench.pair([True], [True])) == 1.0
    low, high = bench.newcombe_paired(t)
    assert low < t.difference < high and 0 < low < 0.05 and 0.15 < high < 0.2
    # At a large N it approaches the Wald interval of the paired difference.
    big = bench.pair(template * 20, tools_first * 20)
    wald = 1.959964 * math.sqrt(((5 + 15) / 100 - 0.1**2) / 2000)
    assert bench.newcombe_paired(big) == pytest.approx((0.1 - wald, 0.1 + wald), abs=0.002)
    # Swapping the layouts mirrors the interval.
    mirrored = bench.newcombe_paired(bench.pair(tools_first, template))
    assert mirrored == pytest.approx((-high, -low))
    # The bootstrap over cases (one a cluster) agrees with Newcombe's within a point or so.
    boot = bench.bootstrap_paired(template * 20, tools_first * 20, list(range(2000)), resamples=4000)
    assert boot == pytest.approx((0.1 - wald, 0.1 + wald), abs=0.01)
    # Clusters of identical cases: resampling them widens the interval.
    clustered = bench.bootstrap_paired(template * 20, tools_first * 20, [i % 100 for i in range(2000)])
    assert clustered[1] - clustered[0] > 3 * (boot[1] - boot[0])


@pytest.fixture(scope="module")
def scripted_llm(scripted_model_dir: Path) -> LLM:
    return LLM(str(scripted_model_dir), kv_cache_memory="64MiB")


def test_a_run_through_the_scripted_model(scripted_llm: LLM) -> None:
    """The scripted model calls get_weather for Paris whatever it is asked: so exactly the cases that
    expect get_weather succeed, under both layouts, and the layouts never disagree."""
    bench, cases = load("layout_quality"), load("layout_cases")
    tokenizer, template = bench.bench_tokenizer(scripted_llm.tokenizer, None)
    assert template == "the model's own"  # the scripted checkpoint carries the Qwen3 template
    all_cases = cases.make_cases(12, seed=13, requests_per_agent=3)
    assert {c.expected == "get_weather" for c in all_cases} == {True, False}
    result = bench.run(scripted_llm, tokenizer, all_cases, ["auto", "required", "named"], 24, max_batch=16)
    assert result.moved == len(all_cases)
    for (tool_choice, _layout), outcomes in result.outcomes.items():
        for case, outcome in zip(all_cases, outcomes, strict=True):
            weather = case.expected == "get_weather"
            assert outcome.success == weather, (tool_choice, case.expected, outcome.reply)
            if tool_choice == "named":
                assert outcome.called and outcome.right_tool  # the name is the server's, forced
            else:
                assert outcome.called and outcome.right_tool == weather
                assert '"get_weather", "arguments": {"city": "Paris"}' in outcome.reply
    text = bench.report(result, "scripted", template, 24)
    n = len(all_cases)
    hits = sum(c.expected == "get_weather" for c in all_cases)
    assert f"N={n}, 4 agents" in text and text.count(f"success {hits / n:6.1%}") == 6
    assert text.count("difference (tools-first - template): +0.0%") == 3
    assert f"discordant: template only 0, tools-first only 0 (both {hits}, neither {n - hits})" in text


def test_tools_first_prompts_hold_the_same_text_moved(scripted_llm: LLM) -> None:
    bench, cases = load("layout_quality"), load("layout_cases")
    tokenizer: Tokenizer = scripted_llm.tokenizer
    trials = bench.render_trials(tokenizer, cases.make_cases(4, seed=2), ["required"])
    for template, moved in zip(trials[::2], trials[1::2], strict=True):
        assert (template.layout, moved.layout) == ("template", "tools-first")
        assert template.text != moved.text and sorted(template.text) == sorted(moved.text)
        assert moved.text.index("# Tools") < moved.text.index("# Environment")
        assert template.text.index("# Environment") < template.text.index("# Tools")
        assert template.text.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "')


@pytest.mark.model
@pytest.mark.slow
def test_the_default_model_with_the_qwen3_template() -> None:
    """The embedded SmolLM2 with Qwen3's template: each forced call parses, names the tool, and is scored."""
    bench, cases = load("layout_quality"), load("layout_cases")
    llm = LLM(kv_cache_memory="256MiB")
    tokenizer, template = bench.bench_tokenizer(llm.tokenizer, None)
    assert template.endswith("tokenizer_files") and tokenizer.template is not llm.tokenizer.template
    two = cases.make_cases(2, seed=0, requests_per_agent=2)
    result = bench.run(llm, tokenizer, two, ["named"], 12)
    assert result.moved == 2
    for layout in bench.LAYOUTS:
        for outcome in result.outcomes["named", layout]:
            assert outcome.called and outcome.right_tool  # the forced opening parses as a call of that tool
    assert "tool_choice=named" in bench.report(result, "smol", template, 12)
