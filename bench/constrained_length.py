"""Sampled `json_schema` replies cut by max_tokens: how many still parse, with the engine closing them at their
length (`close_at_length`, the default) and without.

Run: PYTHONPATH=src:tests:bench python bench/constrained_length.py [--max-tokens 96] [--seeds 5]
Six chat prompts whose schemas hold unbounded strings and string arrays (the kind a sampled reply runs long
in), each at every seed, sampled at temperature 1 (OpenAI's default) on the embedded default model, rendered
and constrained as the server does (`api.render`, `api.structured_request`). One JSON line per setting:
replies, how many were cut (finish_reason length), how many parse, how many validate against their schema,
and the forced ending's tokens per cut reply.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "bench")]

import jsonschema  # noqa: E402

from swarmkv import LLM  # noqa: E402
from swarmkv.api.chat_request import parse_chat_request  # noqa: E402
from swarmkv.api.render import render_request  # noqa: E402
from swarmkv.api.structured_request import reply_constraint, special_markup  # noqa: E402
from swarmkv.core.sampling_params import SamplingParams  # noqa: E402

_STRINGS = {"type": "array", "items": {"type": "string"}}
PROMPTS: list[tuple[str, dict[str, Any]]] = [
    (
        "List the steps to bake bread, as JSON.",
        {"type": "object", "properties": {"steps": _STRINGS}, "required": ["steps"]},
    ),
    (
        "Describe Paris for a travel guide, as JSON.",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "highlights": _STRINGS, "summary": {"type": "string"}},
            "required": ["name", "highlights", "summary"],
        },
    ),
    (
        "Name the files a web project needs and why, as JSON.",
        {
            "type": "object",
            "properties": {
                "files": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {"path": {"type": "string"}, "reason": {"type": "string"}},
                        "required": ["path", "reason"],
                    },
                }
            },
            "required": ["files"],
        },
    ),
    (
        "Review this code: `def f(x): return x*2`. Answer as JSON.",
        {
            "type": "object",
            "properties": {
                "issues": _STRINGS,
                "verdict": {"enum": ["ok", "fix"]},
                "score": {"type": "integer"},
            },
            "required": ["issues", "verdict", "score"],
        },
    ),
    (
        "Write a short story outline as JSON.",
        {
            "type": "object",
            "properties": {"title": {"type": "string"}, "characters": _STRINGS, "plot": _STRINGS},
            "required": ["title", "characters", "plot"],
        },
    ),
    (
        "Summarise the news about space exploration as JSON.",
        {
            "type": "object",
            "properties": {"headline": {"type": "string"}, "tags": _STRINGS, "body": {"type": "string"}},
            "required": ["headline", "tags", "body"],
        },
    ),
]


def requests(llm: LLM, max_tokens: int, seeds: int) -> list[tuple[list[int], SamplingParams, dict[str, Any]]]:
    """Every prompt at every seed: prompt ids, sampling settings and the schema its reply must follow."""
    out = []
    for text, schema in PROMPTS:
        fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
        body = {
            "messages": [{"role": "user", "content": text}],
            "response_format": fmt,
            "max_tokens": max_tokens,
        }
        req, rendered = render_request(llm.tokenizer, parse_chat_request(body))
        constraint = reply_constraint(req, special_markup(llm.tokenizer))
        for seed in range(seeds):
            params = req.options.sampling_params(
                len(rendered.token_ids),
                llm.engine.max_model_len,
                "messages",
                req.forced_stop(),
                constraint=constraint,
            )
            out.append((rendered.token_ids, _seeded(params, seed), schema))
    return out


def _seeded(params: SamplingParams, seed: int) -> SamplingParams:
    fields = {**params.__dict__, "seed": seed, "temperature": 1.0}
    return SamplingParams(**fields)


def run(
    llm: LLM, cases: list[tuple[list[int], SamplingParams, dict[str, Any]]], label: str
) -> dict[str, Any]:
    """Generate every case in one batch; count cut, parsed and valid replies."""
    forced_before = llm.engine.structured.num_forced_tokens
    start = time.perf_counter()
    outputs = llm.generate([c[0] for c in cases], [c[1] for c in cases])
    elapsed_s = time.perf_counter() - start
    cut = parsed = valid = 0
    for (_, _, schema), out in zip(cases, outputs, strict=True):
        cut += out.finish_reason == "length"
        try:
            value = json.loads(out.text)
        except ValueError:
            continue
        parsed += 1
        try:
            jsonschema.validate(value, schema)
            valid += 1
        except jsonschema.ValidationError:
            pass
    return {
        "run": label,
        "replies": len(cases),
        "cut_by_length": cut,
        "parse": parsed,
        "schema_valid": valid,
        "unparseable": len(cases) - parsed,
        "forced_tokens": llm.engine.structured.num_forced_tokens - forced_before,
        "elapsed_s": round(elapsed_s, 2),
    }


def main() -> None:
    """One JSON line per setting: closing at the length on (the default), then off."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    closing = LLM(kv_cache_memory="512MiB", max_model_len=8192)
    cases = requests(closing, args.max_tokens, args.seeds)
    plain = LLM(loaded=closing.loaded, kv_cache_memory="512MiB", max_model_len=8192, close_at_length=False)
    for llm, label in ((closing, "close_at_length"), (plain, "no_close_at_length")):
        print(json.dumps({**run(llm, cases, label), "max_tokens": args.max_tokens}), flush=True)


if __name__ == "__main__":
    main()
