"""The agent swarm over HTTP, shared against per-slot (each agent sends its own `cache_salt`, so it reuses its
own earlier turns but never another agent's pages, as a per-slot server such as `llama-server -np 8` does).

Both servers run in this process on free loopback ports, one after the other, over the same loaded
weights; the swarm driver talks to each exactly as it would to vLLM or llama.cpp. Reported: time to first
token (p50, p95; first turn and later turns), output tokens per second, the cached tokens the server
reports in `usage`, and the prefill work its /metrics counted, with shared / per-slot ratios.

    .venv/bin/python bench/serve.py                      # the short default run (a few minutes on 2 cores)
    .venv/bin/python bench/serve.py --prefix-tokens 2000 --turns 3 --json serve.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from swarmkv.engine.llm import LLM
from swarmkv.models.loader import LoadedModel, load_model
from swarmkv.server import create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.swarm.http_driver import run_swarm_over_http
from swarmkv.swarm.workload import Workload, build_workload, prefix_token_count

MODES = ("shared", "per-slot")
SERVER_COUNTERS = (
    "prompt_tokens",
    "prefill_tokens_computed",
    "prefix_hit_tokens",
    "preemptions",
    "evictions",
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF directory or GGUF file (default: SmolLM2-135M)")
    parser.add_argument(
        "--weights", choices=("auto", "float", "int8", "int4"), default="float", help="projection weights"
    )
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--prefix-tokens", type=int, default=800, help="size of the shared head, in tokens")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    parser.add_argument(
        "--tool-result-tokens", type=int, default=80, help="size of each simulated tool output"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="FILE", help="also write the full reports as JSON")
    return parser.parse_args()


def context_tokens(loaded: LoadedModel, workload: Workload, tool_result_tokens: int) -> int:
    """A context long enough for any agent's last turn, with slack for templating and re-tokenisation."""
    tokenizer = loaded.tokenizer
    head = prefix_token_count(tokenizer, workload.system_prompt, workload.tools)
    task = max(len(tokenizer.encode(a.task)) for a in workload.agents)
    tool = max((len(tokenizer.encode(out)) for a in workload.agents for _, out in a.tool_results), default=0)
    per_turn = workload.max_tokens + tool + 48
    return min(loaded.config.max_position_embeddings, head + task + workload.turns * per_turn + 128)


def scrape_counters(url: str) -> dict[str, float]:
    """The engine counters from /metrics, parsed the way Prometheus would."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return {name: values.get(f"swarmkv_{name}_total", math.nan) for name in SERVER_COUNTERS}


def run_mode(loaded: LoadedModel, workload: Workload, mode: str, max_model_len: int) -> dict[str, Any]:
    """Start a server, drive the swarm through it, stop it; the driver's report plus the server's counters."""
    kv_per_token = loaded.config.kv_bytes_per_token(loaded.dtype)
    # Room for every agent's whole context privately: neither mode is slowed by eviction or preemption.
    pool_bytes = len(workload.agents) * (max_model_len + 32) * kv_per_token
    llm = LLM(
        loaded=loaded,
        kv_cache_memory=pool_bytes,
        max_model_len=max_model_len,
        max_num_seqs=len(workload.agents),
    )
    with BackgroundServer(create_app(llm)) as server:
        start = time.perf_counter()

        def progress(done: int, total: int) -> None:
            if sys.stdout.isatty() or done == total:
                end = "\n" if done == total else ""
                print(f"\r  {done}/{total} turns, {time.perf_counter() - start:6.1f} s", end=end, flush=True)

        per_slot = mode == "per-slot"
        report = asyncio.run(run_swarm_over_http(server.url, workload, progress=progress, per_slot=per_slot))
        report["server"] = scrape_counters(server.url)
    return report


def print_table(reports: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """One row per figure, one column per mode, and shared / per-slot; returns the ratios."""
    rows = [
        ("TTFT p50 (s)", lambda r: r["summary"]["ttft_p50_s"]),
        ("TTFT p95 (s)", lambda r: r["summary"]["ttft_p95_s"]),
        ("TTFT first turn p50 (s)", lambda r: r["summary"]["ttft_first_turn_p50_s"]),
        ("TTFT later turns p50 (s)", lambda r: r["summary"]["ttft_later_turns_p50_s"]),
        ("output tokens/s (all agents)", lambda r: r["summary"]["output_tokens_per_s"]),
        ("decode tokens/s per request p50", lambda r: r["summary"]["decode_tokens_per_s_p50"]),
        ("wall (s)", lambda r: r["wall_s"]),
        ("prompt tokens (usage)", lambda r: r["summary"]["prompt_tokens"]),
        ("cached tokens (usage)", lambda r: r["summary"]["cached_tokens"]),
        ("prefill tokens computed (/metrics)", lambda r: r["server"]["prefill_tokens_computed"]),
        ("preemptions (/metrics)", lambda r: r["server"]["preemptions"]),
    ]
    shared, per_slot = reports["shared"], reports["per-slot"]
    ratios: dict[str, float | None] = {}
    print(f"{'':36}{'shared':>14}{'per-slot':>17}{'ratio':>10}")
    for name, get in rows:
        a, b = get(shared), get(per_slot)
        ratio = round(a / b, 4) if isinstance(a, int | float) and isinstance(b, int | float) and b else None
        ratios[name] = ratio
        print(f"{name:36}{_cell(a):>14}{_cell(b):>17}{_cell(ratio, 'x'):>10}")
    return ratios


def _cell(value: Any, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.3f}{suffix}"
    return f"{int(value):,}{suffix}"


def main() -> None:
    args = parse_args()
    loaded = load_model(args.model, weights=args.weights)
    workload = build_workload(
        loaded.tokenizer,
        agents=args.agents,
        turns=args.turns,
        prefix_tokens=args.prefix_tokens,
        seed=args.seed,
        max_tokens=args.max_tokens,
        tool_result_tokens=args.tool_result_tokens,
    )
    max_model_len = context_tokens(loaded, workload, args.tool_result_tokens)
    head = prefix_token_count(loaded.tokenizer, workload.system_prompt, workload.tools)
    print(
        f"{loaded.name}: {args.agents} agents x {args.turns} turns, shared head {head} tokens "
        f"({len(workload.tools)} tools), {args.max_tokens} tokens per turn, context {max_model_len}"
    )
    reports: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        print(f"{mode}:")
        reports[mode] = run_mode(loaded, workload, mode, max_model_len)
    ratios = print_table(reports)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"args": vars(args), "shared_head_tokens": head, "reports": reports, "ratios": ratios},
                f,
                indent=2,
            )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
