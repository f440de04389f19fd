"""Turn the long swarm's PolicyResults into its report: JSON record, terminal table against targets, plot."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.table import Table

from swarmkv.swarm.long_run import PolicyResult

MIB = 2**20
# The targets a policy's figure should reach, as a fraction of lru's: (figure, policy) -> highest ratio.
TARGETS: dict[tuple[str, str], float] = {
    ("recomputed_tokens", "session"): 0.5,
    ("recomputed_tokens", "return"): 0.5,
    ("recomputed_tokens", "session+offload"): 0.1,
    ("ttft_p95_later_s", "session+offload"): 0.5,
}
# The figures compared with lru, and their labels in the table.
RATIO_FIGURES = {"recomputed_tokens": "recomputed / lru", "ttft_p95_later_s": "TTFT p95 turns>=1 / lru"}


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) with linear interpolation between ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ttft_summary(r: PolicyResult) -> dict[str, float | None]:
    """Median and p95 time to first token over every turn, and p95 over turns after each agent's first."""
    every = [t for turns in r.ttft_s for t in turns]
    later = [t for turns in r.ttft_s for t in turns[1:]]
    return {
        "ttft_p50_s": _round(percentile(every, 50)),
        "ttft_p95_s": _round(percentile(every, 95)),
        "ttft_p95_later_s": _round(percentile(later, 95)),
    }


def policy_record(r: PolicyResult) -> dict[str, Any]:
    """The JSON object for one policy."""
    return {
        "prefill_tokens_computed": r.prefill_tokens_computed,
        "recomputed_tokens": r.recomputed_tokens,
        "prefix_hit_tokens": r.prefix_hit_tokens,
        "evictions": r.evictions,
        "offload_loads": r.offload_loads,
        "offload_load_bytes": r.offload_load_bytes,
        "offload_stores": r.offload_stores,
        "offload_drops": r.offload_drops,
        "preemptions": r.preemptions,
        "swap_preemptions": r.swap_preemptions,
        "recompute_preemptions": r.recompute_preemptions,
        "peak_kv_bytes": r.peak_kv_bytes,
        "peak_offloaded_bytes": r.peak_offloaded_bytes,
        "pool_bytes": r.pool_bytes,
        "subagents": r.subagents,
        "compactions": r.compactions,
        "wall_s": round(r.wall_s, 3),
        "ttft_s": [[round(t, 4) for t in turns] for turns in r.ttft_s],
        **ttft_summary(r),
        "transcript_sha256": r.transcript_sha256,
    }


def ratios_vs_lru(records: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each other policy's recomputed tokens and later-turn TTFT p95 over lru's (None where lru's is 0)."""
    if "lru" not in records:
        return {}
    lru = records["lru"]
    return {
        policy: {name: _ratio(record[name], lru[name]) for name in RATIO_FIGURES}
        for policy, record in records.items()
        if policy != "lru"
    }


def transcripts_identical(results: dict[str, PolicyResult]) -> bool:
    """Whether every policy generated the same tokens (greedy decoding must not depend on the KV policy)."""
    return len({r.transcript_sha256 for r in results.values()}) <= 1


def long_record(
    config: dict[str, Any], results: dict[str, PolicyResult], exact_numerics: bool = True
) -> dict[str, Any]:
    """The whole JSON record: config, one object per policy, ratios against lru, transcript agreement.
    `exact_numerics`: whether a recomputed prefix computes what its decode steps did (float32 or wider, no
    int8 activations), so that the policies' transcripts must agree; otherwise their difference is reported only."""
    modes = {policy: policy_record(r) for policy, r in results.items()}
    return {
        "config": config,
        "modes": modes,
        "ratios": ratios_vs_lru(modes),
        "transcripts_identical": transcripts_identical(results),
        "transcripts_compared": exact_numerics,
    }


def print_long_table(console: Console, record: dict[str, Any]) -> None:
    """One column per policy: the counters, TTFT percentiles, then the ratios to lru against their targets."""
    config, modes, ratios = record["config"], record["modes"], record["ratios"]
    table = Table(
        title=f"long swarm: {config['agents']} agents x {config['turns']} turns, KV pool "
        f"{config['kv_cache_memory'] / MIB:,.0f} MiB for {config['per_slot_context_bytes'] / MIB:,.0f} MiB "
        f"of per-slot context"
    )
    table.add_column("metric")
    for policy in modes:
        table.add_column(policy, justify="right")
    rows: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
        ("prefill computed (tokens)", lambda m: m["prefill_tokens_computed"]),
        ("recomputed (tokens)", lambda m: m["recomputed_tokens"]),
        ("prefix hits (tokens)", lambda m: m["prefix_hit_tokens"]),
        ("evictions (pages)", lambda m: m["evictions"]),
        ("preemptions swap/recompute", lambda m: f"{m['swap_preemptions']} / {m['recompute_preemptions']}"),
        ("offload loads (pages)", lambda m: m["offload_loads"]),
        ("offload loaded (MiB)", lambda m: m["offload_load_bytes"] / MIB),
        ("peak KV device (MiB)", lambda m: m["peak_kv_bytes"] / MIB),
        ("peak KV host (MiB)", lambda m: m["peak_offloaded_bytes"] / MIB),
        ("TTFT p50 (s)", lambda m: m["ttft_p50_s"]),
        ("TTFT p95 (s)", lambda m: m["ttft_p95_s"]),
        ("TTFT p95 turns>=1 (s)", lambda m: m["ttft_p95_later_s"]),
        ("wall (s)", lambda m: m["wall_s"]),
        ("transcript sha256", lambda m: m["transcript_sha256"][:12]),
    ]
    for name, get in rows:
        table.add_row(name, *(_cell(get(m)) for m in modes.values()))
    if ratios:
        table.add_section()
        for figure, label in RATIO_FIGURES.items():
            cells = [
                "1.000x"
                if policy == "lru"
                else _ratio_cell(ratios[policy][figure], TARGETS.get((figure, policy)))
                for policy in modes
            ]
            table.add_row(label, *cells)
    console.print(table)
    if record["transcripts_identical"]:
        return
    if record.get("transcripts_compared", True):
        console.print(
            "[bold red]WARNING: the policies generated different tokens; greedy decoding should not depend "
            "on the KV policy[/]"
        )
    else:
        console.print(
            "The policies' transcripts differ, as they may here: a preempted request's KV is recomputed by a "
            "prefill, whose numerics differ from the decode steps' (int8 activations, or a half-precision "
            "model). Run float32 weights with --no-cpu-int8-activations to compare them exactly."
        )


def save_long_plot(path: str, results: dict[str, PolicyResult]) -> None:
    """KV on the device, KV on the host and recomputed tokens over time, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    panels: list[tuple[str, Callable[[Any], float]]] = [
        ("KV on device (MiB)", lambda s: s.device_bytes / MIB),
        ("KV on host (MiB)", lambda s: s.host_bytes / MIB),
        ("recomputed tokens", lambda s: s.recomputed_tokens),
    ]
    for ax, (label, get) in zip(axes, panels, strict=True):
        for policy, r in results.items():
            ax.plot([s.time_s for s in r.timeline], [get(s) for s in r.timeline], label=policy)
        ax.set_ylabel(label)
        ax.legend()
    axes[0].set_title("long swarm: KV per policy over the run")
    axes[-1].set_xlabel("seconds since the policy's run started")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    return (
        f"{value:,.3f}"
        if isinstance(value, float)
        else f"{value:,}"
        if isinstance(value, int)
        else str(value)
    )


def _ratio_cell(value: float | None, target: float | None) -> str:
    if value is None:
        return "-"
    if target is None:
        return f"{value:.3f}x"
    color = "green" if value <= target else "red"
    return f"[{color}]{value:.3f}x (<= {target}x)[/]"
