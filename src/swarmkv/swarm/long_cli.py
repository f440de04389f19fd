"""`swarmkv swarm --scenario long`: run each KV retention policy on one long-horizon workload and compare."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, cast

from rich.console import Console

import swarmkv.resolve as resolve
from swarmkv.core.config import EngineConfig
from swarmkv.engine.kv_budget import dtype_name
from swarmkv.engine.kv_cache import kv_storage_dtype
from swarmkv.models.loader import LoadedModel, load_model
from swarmkv.options import engine_kwargs
from swarmkv.swarm.long_report import MIB, long_record, print_long_table, save_long_plot
from swarmkv.swarm.long_run import (
    DEFAULT_POLICIES,
    POLICIES,
    ClockName,
    ModelledClock,
    Policy,
    PolicyResult,
    policy_config,
    run_long_swarm,
    session_ids,
)
from swarmkv.swarm.long_workload import LongWorkload, build_long_workload
from swarmkv.swarm.replay import FIXED, fixed_replies, load_replies, record_of
from swarmkv.swarm.report import turns_progress
from swarmkv.swarm.run import warm_up
from swarmkv.swarm.workload import prefix_token_count

LONG_TURNS = 16
# The default pool holds this share of the per-slot context, so sessions compete for it.
POOL_SHARE = 0.4


def parse_policies(text: str | None) -> list[Policy]:
    """The policies `--policies` names, in the order given; the default comparison when it is not given."""
    if text is None:
        return list(DEFAULT_POLICIES)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if unknown or not names:
        raise ValueError(
            f"unknown policy {', '.join(map(repr, unknown)) or repr(text)} in --policies; "
            f"choose from {', '.join(POLICIES)}"
        )
    return [cast(Policy, name) for name in dict.fromkeys(names)]


def check_long_args(args: argparse.Namespace) -> list[Policy]:
    """Refuse arguments the long scenario cannot use, before any model loads; return the policies to run."""
    if args.turns is None:
        args.turns = LONG_TURNS
    if args.agents <= 0 or args.turns <= 0 or args.prefix_tokens <= 0 or args.max_tokens <= 0:
        raise ValueError("--agents, --turns, --prefix-tokens and --max-tokens must be positive")
    if args.time_scale < 0:
        raise ValueError(f"--time-scale must be >= 0, got {args.time_scale}")
    if not 0 <= args.subagent_share <= 1 or not 0 <= args.compact_share <= 1:
        raise ValueError("--subagent-share and --compact-share must lie in [0, 1]")
    if args.server:
        raise ValueError("--scenario long runs the engine in process; --server is for --scenario short")
    if args.replay_replies and args.clock != "model":
        raise ValueError(
            "--replay-replies takes --clock model: a replay computes nothing, so wall time means nothing"
        )
    if args.mode != "both":
        raise ValueError("--mode is for --scenario short; --scenario long compares --policies instead")
    return parse_policies(args.policies)


def run_long(args: argparse.Namespace) -> int:
    """Build the long workload, run each policy on the same loaded model, print and save the report; 1 if
    the policies' transcripts differ where numerics are exact (`exact_numerics`)."""
    policies = check_long_args(args)
    console = Console()
    mtp = resolve.mtp_drafts(args.speculation, args.speculative_method)
    loaded = load_model(args.model, dtype=args.dtype, device=args.device, weights=args.weights, mtp=mtp)
    options = engine_kwargs(args)
    options.pop("offload_memory", None)  # each policy sets its own
    options.pop("kv_cache_memory")  # sized from the workload below unless --kv-cache-memory says otherwise
    base = EngineConfig.from_kwargs(**options)
    # The pool is sized at the model's width (the C step's float16 pages hold twice the tokens of it).
    sizing = resolve.kv_cache_dtype(base.kv_cache_dtype, dtype_name(loaded.dtype))
    kv_per_token = loaded.config.kv_bytes_per_token(kv_storage_dtype(sizing))
    max_context = base.max_model_len or loaded.config.max_position_embeddings
    long = build_long_workload(
        loaded.tokenizer,
        agents=args.agents,
        turns=args.turns,
        prefix_tokens=args.prefix_tokens,
        seed=args.seed,
        max_tokens=args.max_tokens,
        max_context_tokens=max_context,
        subagent_share=args.subagent_share,
        compact_share=args.compact_share or None,
    )
    per_slot_bytes = long.total_context_tokens * kv_per_token
    pool_bytes = args.kv_cache_memory
    if pool_bytes is None:
        # The pool must still hold the longest agent's context, or its last turn could never run.
        longest_bytes = (max(long.context_tokens) // base.block_size + 2) * base.block_size * kv_per_token
        pool_bytes = max(int(POOL_SHARE * per_slot_bytes), longest_bytes)
    offload_bytes = per_slot_bytes if args.offload_memory is None else args.offload_memory
    base = policy_config(dataclasses.replace(base, kv_cache_memory=pool_bytes), "lru", 0, args.agents)
    shared_prefix = prefix_token_count(loaded.tokenizer, long.swarm.system_prompt, long.swarm.tools)
    config = {
        "scenario": "long",
        "model": loaded.name,
        "dtype": str(loaded.dtype).removeprefix("torch."),
        **_config_record(args, policies, base, long),
        "max_model_len": max_context,
        "kv_bytes_per_token": kv_per_token,
        "offload_memory": offload_bytes,
        "shared_prefix_tokens": shared_prefix,
        "per_slot_context_bytes": per_slot_bytes,
    }
    console.print(
        f"[bold]{loaded.name}[/]: {args.agents} agents x {args.turns} turns, shared head {shared_prefix} tokens, "
        f"per-slot context {long.total_context_tokens:,} tokens ({per_slot_bytes / MIB:,.0f} MiB), "
        f"KV pool {base.kv_cache_bytes / MIB:,.0f} MiB, host tier {offload_bytes / MIB:,.0f} MiB"
    )
    replies = None
    if args.replay_replies == FIXED:
        replies = fixed_replies(loaded.tokenizer, args.max_tokens)
    elif args.replay_replies:
        replies = load_replies(args.replay_replies, config)
    else:
        warm_up(loaded, long.swarm, base)
    results = _run_policies(
        console, loaded, long, policies, base, offload_bytes, args.time_scale, args.clock, replies
    )
    if args.record_replies:
        first = results[policies[0]]
        with open(args.record_replies, "w") as f:
            json.dump(record_of(config, session_ids(long), first.token_ids), f)
        console.print(f"wrote {args.record_replies}")
    record = long_record(config, results, exact_numerics(loaded, base))
    print_long_table(console, record)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
        console.print(f"wrote {args.json}")
    if args.plot:
        save_long_plot(args.plot, results)
        console.print(f"wrote {args.plot}")
    return 0 if record["transcripts_identical"] or not record["transcripts_compared"] else 1


def exact_numerics(loaded: LoadedModel, config: EngineConfig) -> bool:
    """Whether a prefill recomputes what decode steps computed, up to summation order: a float32 or wider model
    whose decodes do not round activations to int8 (the CPU's C step over GGUF-held weights does)."""
    wide = str(loaded.dtype) in ("torch.float32", "torch.float64")
    int8_decodes = loaded.model.weights == "gguf" and config.fused_cpu_decode and config.cpu_int8_activations
    return wide and not int8_decodes


def _config_record(
    args: argparse.Namespace, policies: list[Policy], base: EngineConfig, long: LongWorkload
) -> dict[str, Any]:
    """The run's settings for the JSON record: the workload's and the engine's."""
    return {
        "agents": args.agents,
        "turns": args.turns,
        "prefix_tokens": args.prefix_tokens,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "time_scale": args.time_scale,
        "clock": args.clock,
        "policies": list(policies),
        "block_size": base.block_size,
        "max_num_batched_tokens": base.max_num_batched_tokens,
        "kv_cache_memory": base.kv_cache_bytes,
        "context_tokens": list(long.context_tokens),
        "per_slot_context_tokens": long.total_context_tokens,
        "subagent_share": args.subagent_share,
        "subagents": len(long.spawned),
        "compact_tokens": long.compact_tokens,
    }


def _run_policies(
    console: Console,
    loaded: LoadedModel,
    long: LongWorkload,
    policies: list[Policy],
    base: EngineConfig,
    offload_bytes: int,
    time_scale: float,
    clock: ClockName = "wall",
    replies: dict[str, list[int]] | None = None,
) -> dict[str, PolicyResult]:
    results: dict[str, PolicyResult] = {}
    total = len(long.swarm.agents) * long.swarm.turns + sum(
        len(p.script.tool_results) + 1 for p in long.spawned
    )
    with turns_progress(console) as bar:
        for policy in policies:
            task = bar.add_task(f"{policy:>15}", total=total, kv="")

            def progress(done: int, _total: int, r: PolicyResult, task: Any = task) -> None:
                last = r.timeline[-1] if r.timeline else None
                kv = (
                    f"device {last.device_bytes / MIB:,.0f} MiB, host {last.host_bytes / MIB:,.0f} MiB"
                    if last
                    else ""
                )
                bar.update(task, completed=done, kv=kv)

            config = policy_config(base, policy, offload_bytes, len(long.swarm.agents))
            run_clock = ModelledClock() if clock == "model" else None
            results[policy] = run_long_swarm(
                loaded, long, policy, config, time_scale, progress, run_clock, replies
            )
    return results
