"""Turn two ModeResults into the swarm report: JSON record, terminal table and plot."""

from __future__ import annotations

import statistics
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from swarmkv.swarm.run import ModeResult
from swarmkv.units import GIB


def turns_progress(console: Console) -> Progress:
    """The swarm's progress bar: one task per mode or policy, turns done, a KV field, elapsed time."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("turns"),
        TextColumn("{task.fields[kv]}"),
        TimeElapsedColumn(),
        console=console,
    )


def mode_record(r: ModeResult) -> dict[str, Any]:
    """The JSON object for one mode."""
    return {
        "peak_kv_bytes": r.peak_kv_bytes,
        "final_kv_bytes": r.final_kv_bytes,
        "prompt_tokens": r.prompt_tokens,
        "prefill_tokens_computed": r.prefill_tokens_computed,
        "prefix_hit_tokens": r.prefix_hit_tokens,
        "prefix_hit_rate": round(r.hit_rate, 4),
        "recomputed_tokens": r.recomputed_tokens,
        "generated_tokens": r.generated_tokens,
        "decode_tokens": r.decode_tokens,
        "cascade_decode_rows": r.cascade_decode_rows,
        "wall_s": round(r.wall_s, 3),
        "decode_s": round(r.decode_s, 3),
        "ttft_s": [[round(t, 4) for t in turns] for turns in r.ttft_s],
        "decode_tokens_per_s": round(r.decode_tokens_per_s, 2),
        "pool_bytes": r.pool_bytes,
    }


def json_key(mode: str) -> str:
    """The key a mode has under `modes` in the JSON record: `per-slot` -> `per_slot`."""
    return mode.replace("-", "_")


def ratios(shared: ModeResult, per_slot: ModeResult) -> dict[str, float]:
    """Shared over per-slot for the headline figures (lower is better for all three)."""

    def ratio(a: float, b: float) -> float:
        return round(a / b, 4) if b else float("nan")

    return {
        "peak_kv_bytes": ratio(shared.peak_kv_bytes, per_slot.peak_kv_bytes),
        "prefill_tokens_computed": ratio(shared.prefill_tokens_computed, per_slot.prefill_tokens_computed),
        "wall_s": ratio(shared.wall_s, per_slot.wall_s),
    }


def _ttft(r: ModeResult, first: bool) -> float:
    values = (
        [turns[0] for turns in r.ttft_s if turns] if first else [t for turns in r.ttft_s for t in turns[1:]]
    )
    return statistics.median(values) if values else float("nan")


def print_table(console: Console, results: dict[str, ModeResult], config: dict[str, Any]) -> None:
    """The final table, plus the KV reclaimed when both modes ran."""
    table = Table(
        title=f"swarm: {config['agents']} agents x {config['turns']} turns, "
        f"shared head {config['shared_prefix_tokens']} tokens"
    )
    table.add_column("metric")
    for mode in results:
        table.add_column(mode, justify="right")
    both = "shared" in results and "per-slot" in results
    if both:
        table.add_column("shared / per-slot", justify="right")
    rows: list[tuple[str, Any]] = [
        ("peak KV (GiB)", lambda r: r.peak_kv_bytes / GIB),
        ("final KV (GiB)", lambda r: r.final_kv_bytes / GIB),
        ("prompt tokens", lambda r: r.prompt_tokens),
        ("prefill tokens computed", lambda r: r.prefill_tokens_computed),
        ("prefix hit tokens", lambda r: r.prefix_hit_tokens),
        ("prefix hit rate", lambda r: r.hit_rate),
        ("recomputed tokens", lambda r: r.recomputed_tokens),
        ("TTFT first turn, median (s)", lambda r: _ttft(r, True)),
        ("TTFT later turns, median (s)", lambda r: _ttft(r, False)),
        ("decode tokens", lambda r: r.decode_tokens),
        ("decode tokens/s", lambda r: r.decode_tokens_per_s),
        ("cascade decode rows", lambda r: r.cascade_decode_rows),
        ("wall (s)", lambda r: r.wall_s),
    ]
    for name, get in rows:
        values = [get(r) for r in results.values()]
        cells = [f"{v:,.3f}" if isinstance(v, float) else f"{v:,}" for v in values]
        if both:
            s, p = get(results["shared"]), get(results["per-slot"])
            cells.append(f"{s / p:.3f}x" if p else "-")
        table.add_row(name, *cells)
    console.print(table)
    console.print(_ttft_table(results))
    if both:
        reclaimed = results["per-slot"].peak_kv_bytes - results["shared"].peak_kv_bytes
        pool = results["shared"].pool_bytes
        console.print(
            f"KV reclaimed by sharing: {reclaimed:,} bytes ({reclaimed / GIB:.3f} GiB), "
            f"{reclaimed / pool:.1%} of the {pool / GIB:.2f} GiB pool"
        )


def _ttft_table(results: dict[str, ModeResult]) -> Table:
    """Time to first token of each agent: its first turn, and the mean of its later turns."""
    table = Table(title="time to first token per agent (s)")
    table.add_column("agent")
    for mode in results:
        table.add_column(f"{mode} first", justify="right")
        table.add_column(f"{mode} later", justify="right")
    num_agents = max(len(r.ttft_s) for r in results.values())
    for agent in range(num_agents):
        cells = []
        for r in results.values():
            turns = r.ttft_s[agent] if agent < len(r.ttft_s) else []
            cells.append(f"{turns[0]:.2f}" if turns else "-")
            cells.append(f"{statistics.mean(turns[1:]):.2f}" if len(turns) > 1 else "-")
        table.add_row(str(agent), *cells)
    return table


def save_plot(path: str, results: dict[str, ModeResult], shared_prefix_tokens: int) -> None:
    """KV bytes over engine steps per mode, and per agent the tokens it shares against those it owns."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, r in results.items():
        left.plot([b / 2**20 for b in r.kv_bytes_timeline], label=mode)
    left.set_xlabel("engine step")
    left.set_ylabel("KV in use or cached (MiB)")
    left.set_title("KV bytes over the run")
    left.legend()
    any_result = next(iter(results.values()))
    owned = [max(0, t - shared_prefix_tokens) for t in any_result.agent_tokens]
    xs = range(len(owned))
    right.bar(xs, [shared_prefix_tokens] * len(owned), label="shared head", color="#d8a31a")
    right.bar(xs, owned, bottom=[shared_prefix_tokens] * len(owned), label="owned tail", color="#4a7fb5")
    right.set_xlabel("agent")
    right.set_ylabel("tokens")
    right.set_title("tokens shared vs owned per agent")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
