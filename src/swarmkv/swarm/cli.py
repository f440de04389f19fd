"""`swarmkv swarm`: run the agent swarm shared and per-slot and report the KV it reclaims (`--scenario
short`), or run a long-horizon swarm under each KV retention policy (`--scenario long`, in long_cli.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any, cast

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import swarmkv.resolve as resolve
from swarmkv.core.config import EngineConfig
from swarmkv.engine.kv_budget import kv_page_dtype
from swarmkv.engine.kv_cache import kv_storage_dtype
from swarmkv.models.default import default_model_path
from swarmkv.models.loader import load_model
from swarmkv.options import add_engine_arguments, add_model_arguments, engine_kwargs
from swarmkv.swarm.http_driver import run_swarm_over_http
from swarmkv.swarm.long_cli import LONG_TURNS, run_long
from swarmkv.swarm.long_run import CLOCKS, DEFAULT_POLICIES, POLICIES
from swarmkv.swarm.report import json_key, mode_record, print_table, ratios, save_plot, turns_progress
from swarmkv.swarm.run import MODES, Mode, ModeResult, pool_bytes_for, run_swarm, warm_up
from swarmkv.swarm.workload import Workload, build_workload, prefix_token_count
from swarmkv.tokenizer import Tokenizer
from swarmkv.units import parse_size

SHORT_TURNS = 3


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `swarm` subcommand."""
    parser = subparsers.add_parser("swarm", help="run an agent swarm with and without prefix sharing")
    add_model_arguments(parser)
    # The swarm runs one request per agent and picks the prefix index's salts by mode; its pool and host
    # tier are sized from the workload unless --kv-cache-memory and --offload-memory say otherwise.
    add_engine_arguments(parser, skip=("max_num_seqs", "prefix_caching", "kv_cache_memory", "offload_memory"))
    parser.add_argument(
        "--scenario",
        choices=("short", "long"),
        default="short",
        help="short: a few turns, shared vs per-slot KV; long: many turns with tool pauses, each --policies",
    )
    parser.add_argument(
        "--kv-cache-memory",
        type=parse_size,
        default=None,
        help="KV pool size, e.g. 512MiB, 2GiB (default: short holds every agent's context privately; long "
        "holds 40%% of it)",
    )
    parser.add_argument(
        "--offload-memory",
        type=parse_size,
        default=None,
        help="host KV tier, e.g. 4GiB (default: short the engine's auto, none on the CPU; long gives "
        "session+offload every agent's whole context)",
    )
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument(
        "--turns",
        type=int,
        default=None,
        help=f"turns per agent (default: short {SHORT_TURNS}, long {LONG_TURNS})",
    )
    parser.add_argument("--prefix-tokens", type=int, default=2000, help="size of the shared head, in tokens")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens generated per turn")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload (tasks, tool outputs)")
    parser.add_argument(
        "--mode",
        choices=("both", *MODES),
        default="both",
        help="the KV layouts to run (default both)",
    )
    parser.add_argument(
        "--policies",
        default=None,
        help=f"long: comma-separated KV retention policies to compare, of {','.join(POLICIES)} "
        f"(default {','.join(DEFAULT_POLICIES)})",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="long: multiplier of the agents' tool pauses (0.2-5 s each); 0 runs them back to back",
    )
    parser.add_argument(
        "--clock",
        choices=CLOCKS,
        default="wall",
        help="long: wall (each step takes what it takes here) or model (time moves by a fixed cost per step "
        "and token, so the run repeats exactly on any machine at any load; its times are modelled)",
    )
    parser.add_argument(
        "--record-replies",
        default=None,
        help="long: write every turn's generated token ids (of the first policy) to this JSON file",
    )
    parser.add_argument(
        "--replay-replies",
        default=None,
        help="long: take every turn's reply from a file --record-replies wrote instead of running the model "
        "(float32 transcripts are the same under every policy), or 'fixed': one fixed text; needs --clock model",
    )
    parser.add_argument(
        "--subagent-share",
        type=float,
        default=0.44,
        help="long: share of agents that delegate one tool call to a subagent session (default 0.44)",
    )
    parser.add_argument(
        "--compact-share",
        type=float,
        default=0.8,
        help="long: the harness compacts a prompt longer than this share of the context, as agent harnesses"
        " auto-compact near the window's end (0: never; default 0.8)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the measurements as JSON")
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="write a plot of KV over time (short: and per agent; long: and on the host)",
    )
    parser.add_argument(
        "--server", metavar="URL", help="drive an OpenAI-compatible server instead (--model names it)"
    )
    parser.add_argument("--api-key", default=None, help="bearer token for --server")
    parser.set_defaults(run=run)


def selected_modes(mode: str) -> list[Mode]:
    """The layouts `--mode` asks for, in running order."""
    if mode == "both":
        return list(MODES)
    return [cast(Mode, mode)]


def run(args: argparse.Namespace) -> int:
    """Build the workload, run each mode on the same loaded model, print and save the report."""
    if args.scenario == "long":
        return run_long(args)
    if args.policies is not None:
        raise ValueError("--policies is for --scenario long")
    if args.turns is None:
        args.turns = SHORT_TURNS
    if args.agents <= 0 or args.turns <= 0 or args.prefix_tokens <= 0 or args.max_tokens <= 0:
        raise ValueError("--agents, --turns, --prefix-tokens and --max-tokens must be positive")
    console = Console()
    if args.server:
        return run_over_http(args, console)
    mtp = resolve.mtp_drafts(args.speculation, args.speculative_method)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device, weights=args.weights, mtp=mtp)
    tokenizer = loaded.tokenizer
    workload = _workload(args, tokenizer)
    shared_prefix = prefix_token_count(tokenizer, workload.system_prompt, workload.tools)
    kv_per_token = loaded.config.kv_bytes_per_token(loaded.dtype)
    first_prompt = shared_prefix + max(len(tokenizer.encode(a.task)) for a in workload.agents) + 16
    options = engine_kwargs(args)
    if options.get("offload_memory", 0) is None:
        del options["offload_memory"]  # the engine's default: auto (none on the CPU)
    if options["kv_cache_memory"] is None:
        options["kv_cache_memory"] = pool_bytes_for(
            workload, first_prompt + 256 * workload.turns, kv_per_token
        )
    engine_config = EngineConfig.from_kwargs(**options)
    # What the pages hold (float16 under a float32 model the CPU's C step decodes), not the pool's sizing above.
    page_dtype = kv_page_dtype(loaded, engine_config)
    page_bytes_per_token = loaded.config.kv_bytes_per_token(kv_storage_dtype(page_dtype))
    config: dict[str, Any] = {
        "model": loaded.name,
        "agents": args.agents,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "block_size": engine_config.block_size,
        "max_num_batched_tokens": engine_config.max_num_batched_tokens,
        "max_model_len": engine_config.max_model_len,
        "cascade_attention": engine_config.cascade_attention,
        "kv_bytes_per_token": page_bytes_per_token,
        "kv_cache_dtype": page_dtype,
        "kv_cache_memory": engine_config.kv_cache_bytes,
        "shared_prefix_tokens": shared_prefix,
        "tools": len(workload.tools),
        "dtype": str(loaded.dtype).removeprefix("torch."),
    }
    console.print(
        f"[bold]{loaded.name}[/]: {args.agents} agents, {args.turns} turns, shared head "
        f"{shared_prefix} tokens ({len(workload.tools)} tools), KV {page_bytes_per_token:,} B/token ({page_dtype})"
    )
    warm_up(loaded, workload, engine_config)
    results: dict[str, ModeResult] = {}
    with turns_progress(console) as bar:
        for mode in selected_modes(args.mode):
            task = bar.add_task(f"{mode:>8}", total=len(workload.agents) * workload.turns, kv="")

            def progress(done: int, total: int, r: ModeResult, task: Any = task) -> None:
                kv = r.kv_bytes_timeline[-1] if r.kv_bytes_timeline else 0
                bar.update(task, completed=done, kv=f"KV {kv / 2**20:,.1f} MiB")

            results[mode] = run_swarm(loaded, workload, mode, engine_config, progress=progress)
    print_table(console, results, config)
    record: dict[str, Any] = {
        "config": config,
        "modes": {json_key(m): mode_record(r) for m, r in results.items()},
    }
    if "shared" in results and "per-slot" in results:
        shared, per_slot = results["shared"], results["per-slot"]
        record["ratios"] = ratios(shared, per_slot)
        record["kv_reclaimed_bytes"] = per_slot.peak_kv_bytes - shared.peak_kv_bytes
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
        console.print(f"wrote {args.json}")
    if args.plot:
        save_plot(args.plot, results, shared_prefix)
        console.print(f"wrote {args.plot}")
    return 0


def run_over_http(args: argparse.Namespace, console: Console) -> int:
    """`--server URL`: the same workload, sized with the default model's tokenizer, sent over HTTP; with
    `--mode per-slot` each agent sends its own `cache_salt`."""
    from swarmkv.models.gguf_file import read_gguf_metadata  # the gguf package: only for GGUF files

    tokenizer = Tokenizer.from_gguf_metadata(read_gguf_metadata(default_model_path()))
    workload = _workload(args, tokenizer)
    with Progress(
        TextColumn("http"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as bar:
        task = bar.add_task("http", total=len(workload.agents) * workload.turns)
        report = asyncio.run(
            run_swarm_over_http(
                args.server,
                workload,
                model=args.model,
                api_key=args.api_key,
                progress=lambda done, total: bar.update(task, completed=done),
                per_slot=selected_modes(args.mode) == ["per-slot"],
            )
        )
    table = Table(title=f"{args.server} ({report['model']}): {args.agents} agents x {args.turns} turns")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in report["summary"].items():
        table.add_row(key, "-" if value is None else f"{value:,}")
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        console.print(f"wrote {args.json}")
    return 0


def _workload(args: argparse.Namespace, tokenizer: Tokenizer) -> Workload:
    return build_workload(
        tokenizer,
        agents=args.agents,
        turns=args.turns,
        prefix_tokens=args.prefix_tokens,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
