"""Structured outputs on the embedded model: unconstrained against constrained, on tool-calling and JSON prompts.

Run: PYTHONPATH=src:tests:bench python bench/structured.py [--quick] [--compare-libraries]
The prompts are generated from a fixed, committed set of tools and tasks (bench/layout_cases.py's coding
tools and the JSON tasks below): each tool case is a forced call (tool_choice "required", the tools of its
agent offered), each JSON case a `response_format` json_schema. Both runs render through the server's own
renderer and grammar builder (`api.render`, `api.structured_request`). It reports the valid-JSON rate, the
schema-valid rate and the right tool chosen, with replies cut by max_tokens counted apart, and decode
tokens/s at batch 1 and 8 for each run (same run, same machine, so the ratio holds beside other load). The
constrained runs: one forced token a step (the CPU default), jump-forward on, and the loop guard off.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "bench")]

import jsonschema  # noqa: E402

import layout_cases  # noqa: E402
from swarmkv import LLM  # noqa: E402
from swarmkv.api.chat_request import parse_chat_request  # noqa: E402
from swarmkv.api.render import render_request  # noqa: E402
from swarmkv.api.structured_request import reply_constraint, special_markup  # noqa: E402
from swarmkv.api.tool_parser import parse_tool_calls  # noqa: E402
from swarmkv.core.sampling_params import SamplingParams  # noqa: E402

JSON_TASKS: list[tuple[str, dict[str, Any]]] = [
    (
        "Describe the city of {x} as JSON.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "country": {"type": "string", "maxLength": 40},
                "population": {"type": "integer", "minimum": 0},
            },
            "required": ["name", "country", "population"],
            "additionalProperties": False,
        },
    ),
    (
        "Classify this review as JSON: '{x} was great.'",
        {
            "type": "object",
            "properties": {
                "sentiment": {"enum": ["positive", "negative", "neutral"]},
                "confidence": {"type": "number", "minimum": 0, "maximum": 1},
            },
            "required": ["sentiment", "confidence"],
            "additionalProperties": False,
        },
    ),
    (
        "List two tags for an article about {x}, as JSON.",
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 20},
                    "minItems": 2,
                    "maxItems": 2,
                }
            },
            "required": ["tags"],
            "additionalProperties": False,
        },
    ),
]
SUBJECTS = ["Paris", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo", "Hanoi", "Quito", "Perth", "Dakar"]


def make_cases(num_tool: int, num_json: int) -> list[dict[str, Any]]:
    """Chat bodies with what each must produce: a tool case's expected tool, a JSON case's schema."""
    cases = []
    for case in layout_cases.make_cases(num_tool, seed=28):
        body = {"messages": case.messages(), "tools": case.tools, "tool_choice": "required"}
        cases.append({"body": body, "tool": case.expected})
    rng = random.Random(28)
    for i in range(num_json):
        task, schema = JSON_TASKS[i % len(JSON_TASKS)]
        fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}}
        text = task.format(x=rng.choice(SUBJECTS))
        cases.append(
            {
                "body": {"messages": [{"role": "user", "content": text}], "response_format": fmt},
                "schema": schema,
            }
        )
    return cases


def _prepare(
    llm: LLM, case: dict[str, Any], constrained: bool, max_tokens: int
) -> tuple[Any, list[int], SamplingParams]:
    body = {**case["body"], "max_tokens": max_tokens, "temperature": 0}
    req, rendered = render_request(llm.tokenizer, parse_chat_request(body))
    constraint = reply_constraint(req, special_markup(llm.tokenizer)) if constrained else None
    params = req.options.sampling_params(
        len(rendered.token_ids), 8192, "messages", req.forced_stop(), constraint=constraint
    )
    return req, rendered.token_ids, params


def _score(req: Any, case: dict[str, Any], out: Any) -> dict[str, bool]:
    """valid_json, schema_valid, right_tool (tool cases), cut (by max_tokens)."""
    cut = out.finish_reason == "length"
    if "tool" in case:
        parsed = parse_tool_calls(
            req.forced_call_opening() + out.text, fmt=req.tool_format, tools=req.prompt_tools
        )
        if len(parsed.tool_calls) != 1:
            return {"valid_json": False, "schema_valid": False, "right_tool": False, "cut": cut}
        call = parsed.tool_calls[0]
        schema = layout_cases.TOOLS.get(call.name, {}).get("function", {}).get("parameters")
        try:
            arguments = json.loads(call.arguments)
        except ValueError:
            return {
                "valid_json": False,
                "schema_valid": False,
                "right_tool": call.name == case["tool"],
                "cut": cut,
            }
        return {
            "valid_json": True,
            "schema_valid": schema is not None and _valid(arguments, schema),
            "right_tool": call.name == case["tool"],
            "cut": cut,
        }
    try:
        value = json.loads(out.text)
    except ValueError:
        return {"valid_json": False, "schema_valid": False, "cut": cut}
    return {"valid_json": True, "schema_valid": _valid(value, case["schema"]), "cut": cut}


def _valid(value: Any, schema: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


@dataclass
class _Out:
    text: str
    finish_reason: str | None
    token_ids: list[int]


def _generate_timed(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[list[_Out], int, float]:
    """Run a batch through the engine: its outputs, and the tokens and seconds of its decode steps taken
    while the whole batch is still running (a shrinking batch's tail, and prefill, are not batch-N decode)."""
    engine = llm.engine
    ids = [f"bench-{next(_IDS)}" for _ in prompts]
    for rid, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(rid, prompt, p)
    seqs = {rid: engine.get_sequence(rid) for rid in ids}
    texts: dict[str, list[str]] = {rid: [] for rid in ids}
    reasons: dict[str, str | None] = {}
    decode_tokens, decode_s, decode_steps = 0, 0.0, 0
    while engine.has_unfinished():
        decoding = (
            decode_steps < DECODE_STEPS
            and not reasons
            and all(s is not None and s.output_token_ids for s in seqs.values())
        )
        decode_steps += decoding
        start = time.perf_counter()
        deltas = engine.step()
        elapsed = time.perf_counter() - start
        for delta in deltas:
            texts[delta.request_id].append(delta.new_text)
            if delta.finished:
                reasons[delta.request_id] = delta.finish_reason
        if decoding:
            decode_s += elapsed
            decode_tokens += sum(len(d.new_token_ids) for d in deltas)
    outs = []
    for rid in ids:
        seq = seqs[rid]
        assert seq is not None
        outs.append(_Out("".join(texts[rid]), reasons.get(rid), list(seq.output_token_ids)))
    return outs, decode_tokens, decode_s


_IDS = itertools.count()
# Decode steps timed per batch: the first ones at the full batch, which constrained and unconstrained replies
# both reach (a constrained reply is short; an unconstrained one may run to max_tokens).
DECODE_STEPS = 12


def run(
    llm: LLM, cases: list[dict[str, Any]], constrained: bool, batch: int, max_tokens: int
) -> dict[str, Any]:
    """Every case in batches of `batch`; rates over the replies not cut, and decode tokens/s."""
    scores, tokens, elapsed = [], 0, 0.0
    before = llm.engine.stats()
    for start in range(0, len(cases), batch):
        group = cases[start : start + batch]
        prepared = [_prepare(llm, c, constrained, max_tokens) for c in group]
        outs, decode_tokens, decode_s = _generate_timed(
            llm, [p[1] for p in prepared], [p[2] for p in prepared]
        )
        tokens += decode_tokens
        elapsed += decode_s
        scores += [_score(p[0], c, o) for p, c, o in zip(prepared, group, outs, strict=True)]
    kept = [s for s in scores if not s["cut"]]
    tool_scores = [s for s in kept if "right_tool" in s]

    def rate(rows: list[dict[str, bool]], key: str) -> float | None:
        return round(sum(r[key] for r in rows) / len(rows), 3) if rows else None

    return {
        "constrained": constrained,
        "jump_forward": llm.engine.structured.jump_forward,
        "loop_guard": llm.engine.config.loop_guard,
        "batch": batch,
        "cases": len(scores),
        "cut_by_max_tokens": len(scores) - len(kept),
        "valid_json": rate(kept, "valid_json"),
        "schema_valid": rate(kept, "schema_valid"),
        "right_tool": rate(tool_scores, "right_tool"),
        "decode_tokens_per_s": round(tokens / elapsed, 1) if elapsed else None,
        **{k: llm.engine.stats()[k] - before[k] for k in ("loop_guard_penalties", "loop_guard_closing")},
    }


def main() -> None:
    """Print one JSON line per (run, batch) and the constrained/unconstrained decode ratios per batch."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a dozen cases, for a test")
    parser.add_argument("--compare-libraries", action="store_true", help="xgrammar against llguidance only")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--num-cases", type=int, help="run the first N of the set's cases (default: all 210)")
    parser.add_argument("--batch1-cases", type=int, default=24, help="cases, spread over the set, at batch 1")
    parser.add_argument(
        "--batches", type=int, nargs="+", choices=(1, 8), help="default: 8 then 1 (--quick: 8)"
    )
    args = parser.parse_args()
    if args.compare_libraries:
        import structured_libraries

        structured_libraries.main()
        return
    num_tool, num_json = (8, 4) if args.quick else (140, 70)
    if args.num_cases is not None:  # a smaller run of the same set: two tool cases to one JSON case
        num_tool, num_json = args.num_cases - args.num_cases // 3, args.num_cases // 3
    cases = make_cases(num_tool, num_json)
    llm = LLM(kv_cache_memory="512MiB", max_model_len=8192)  # jump_forward auto: off on the CPU
    jumping = LLM(loaded=llm.loaded, kv_cache_memory="512MiB", max_model_len=8192, jump_forward="on")
    unguarded = LLM(loaded=llm.loaded, kv_cache_memory="512MiB", max_model_len=8192, loop_guard="off")
    batches = args.batches or ((8,) if args.quick else (8, 1))
    for batch in batches:
        subset = cases if batch == 8 else cases[:: max(1, len(cases) // args.batch1_cases)]
        runs = [(llm, False), (llm, True), (jumping, True), (unguarded, True)]
        rows = [run(engine, subset, constrained, batch, args.max_tokens) for engine, constrained in runs]
        for row in rows:
            print(json.dumps(row), flush=True)
        base = rows[0]["decode_tokens_per_s"] or 1.0
        ratios = {
            "batch": batch,
            "constrained_over_unconstrained": round((rows[1]["decode_tokens_per_s"] or 0) / base, 3),
            "constrained_jump_forward_over_unconstrained": round(
                (rows[2]["decode_tokens_per_s"] or 0) / base, 3
            ),
            "constrained_without_loop_guard_over_unconstrained": round(
                (rows[3]["decode_tokens_per_s"] or 0) / base, 3
            ),
        }
        print(json.dumps(ratios), flush=True)


if __name__ == "__main__":
    main()
