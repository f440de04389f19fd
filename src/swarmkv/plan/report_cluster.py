"""`swarmkv plan --replicas`: the cluster simulator run from the flags, its table, `--json` object and plot.

Every row replays the same synthetic multi-swarm trace (swarmkv.cluster.trace; `--sim-trace harness` shapes
its first requests as the coding harnesses') through the router over
replicas that each have the same KV budget. A reference row runs it on one replica whose KV holds the whole
trace: the hit rate a single cache could reach if it were big enough. The 1-replica row of the sweep has
only the per-replica budget and thrashes once the trace's live swarms outgrow it, so the sweep's own
1-replica figure is a capacity bound, not the sharing bound; the routing target is measured against the
reference.

Each row also runs a second time, its replicas' prefill slowed so that the reference's prefill tokens over
the trace's arrival span would keep them `--sim-busy` (80%) busy: that run gives the row's p95 queueing delay.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

from swarmkv.cluster.routing import POLICIES, Policy
from swarmkv.cluster.simulate import ClusterSpec, SimResult, arrival_span_s, reference, sweep
from swarmkv.cluster.trace import HARNESSES, TraceConfig, make_trace
from swarmkv.plan.flags import KV_SHAPE_FLAGS, parse_counts, resolve_checkpoint
from swarmkv.plan.layout import size, table
from swarmkv.units import parse_size

FOUNDING_KV_BYTES_PER_TOKEN = 2 * 40 * 8 * 128 * 2  # 40 layers, 8 KV heads of 128, fp16: 160 KiB
DEFAULT_REPLICA_KV = "16GiB"


@dataclass(frozen=True)
class ClusterReport:
    """A sweep's results with what it ran on: the trace, the replicas' KV and the model's bytes per token."""

    trace: TraceConfig
    page_size: int
    pages_per_replica: int
    kv_bytes_per_token: int
    reference: SimResult
    results: tuple[SimResult, ...]
    retention: str = "session"  # the replicas' (and the router's shadows') eviction policy
    busy: float = 0.8  # the fraction of the replicas' prefill time the queueing runs keep busy
    arrival_span_s: float = 0.0  # the trace's first to last arrival

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of KV."""
        return self.page_size * self.kv_bytes_per_token

    @property
    def replica_kv_bytes(self) -> int:
        """Each replica's KV budget."""
        return self.pages_per_replica * self.page_bytes


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _result_json(report: ClusterReport, result: SimResult) -> dict[str, Any]:
    return {
        "replicas": result.replicas,
        "policy": result.policy,
        "hit_rate": round(result.hit_rate, 6),
        "prompt_tokens": result.prompt_tokens,
        "prefix_hit_tokens": result.hit_tokens,
        "prefill_tokens_computed": result.prefill_tokens,
        "kv_bytes_cached": result.cached_pages * report.page_bytes,
        "evicted_pages": result.evictions,
        "head_copies": round(result.head_copies, 4),
        "requests_per_replica": list(result.requests_per_replica),
        "prefill_tokens_per_replica": list(result.prefill_tokens_per_replica),
        "busiest_requests_over_mean": round(result.request_skew, 4),
        "busiest_prefill_tokens_over_mean": round(result.prefill_skew, 4),
        "p95_queue_delay_s": round(result.p95_queue_delay_s, 4),
        "busy_prefill_tokens_per_s": round(result.prefill_tokens_per_s, 3),
        "busy_hit_rate": None if result.busy_hit_rate is None else round(result.busy_hit_rate, 6),
        "busy_busiest_requests_over_mean": _rounded(result.busy_request_skew),
        "busy_busiest_prefill_tokens_over_mean": _rounded(result.busy_prefill_skew),
        "decisions": result.decisions,
    }


def to_json(report: ClusterReport) -> dict[str, Any]:
    """The `--json` object: bytes and token counts throughout."""
    trace = report.trace
    return {
        "trace": {
            "shape": trace.shape,
            "swarms": trace.swarms,
            "agents": trace.agents,
            "turns": trace.turns,
            "head_tokens": trace.head_tokens,
            "seed": trace.seed,
        },
        "page_size": report.page_size,
        "pages_per_replica": report.pages_per_replica,
        "kv_bytes_per_token": report.kv_bytes_per_token,
        "replica_kv_bytes": report.replica_kv_bytes,
        "retention": report.retention,
        "busy": report.busy,
        "arrival_span_s": round(report.arrival_span_s, 3),
        "reference": _result_json(report, report.reference),
        "rows": [_result_json(report, r) for r in report.results],
    }


def _cells(report: ClusterReport, result: SimResult) -> list[str]:
    spread = result.requests_per_replica
    return [
        str(result.replicas),
        result.policy,
        f"{100 * result.hit_rate:.1f}%",
        f"{100 * (result.hit_rate - report.reference.hit_rate):+.1f}",
        f"{result.prefill_tokens:,}",
        size(result.cached_pages * report.page_bytes),
        f"{result.head_copies:.2f}",
        f"{min(spread)}-{max(spread)}",
        f"{result.request_skew:.2f}x",
        f"{result.prefill_skew:.2f}x",
        f"{result.evictions:,}",
        f"{result.p95_queue_delay_s:,.1f}",
        "-" if result.busy_hit_rate is None else f"{100 * result.busy_hit_rate:.1f}%",
    ]


def _heads(trace: TraceConfig) -> str:
    if trace.shape == "synthetic":
        return f"each swarm its own head of ~{trace.head_tokens} tokens"
    firsts = ", ".join(f"{h.name} {h.shared_tokens:,} of {h.first_request_tokens:,}" for h in HARNESSES)
    return f"harness-shaped: the swarms take {len(HARNESSES)} harnesses' heads in turn (shared of first request: {firsts})"


def report_text(report: ClusterReport) -> str:
    """The printed report: what ran, the reference, then one row per replica count and policy."""
    t, ref = report.trace, report.reference
    headers = [
        "replicas",
        "policy",
        "hit rate",
        "vs ref (pts)",
        "prefill tokens",
        "KV cached",
        "head copies",
        "requests/replica",
        "max/mean req",
        "max/mean prefill",
        "evicted pages",
        "p95 wait (s)",
        "busy hit rate",
    ]
    lines = [
        f"Cluster simulator: {t.swarms} swarms x {t.agents} agents x {t.turns} turns, {_heads(t)}, seed {t.seed};"
        f" {sum(ref.requests_per_replica):,} requests, {ref.prompt_tokens:,} prompt tokens.",
        f"Each replica: {size(report.replica_kv_bytes)} of KV = {report.pages_per_replica:,} pages of"
        f" {report.page_size} tokens at {report.kv_bytes_per_token // 1024} KiB per token, {report.retention}"
        " retention.",
        f"Reference: 1 replica whose KV holds the whole trace (no eviction): hit rate {100 * ref.hit_rate:.1f}%,"
        f" {ref.prefill_tokens:,} prefill tokens, {size(ref.cached_pages * report.page_bytes)} cached.",
        "The 1-replica row below has the per-replica budget only: it is bound by capacity, not by routing.",
        f"Queueing: one FIFO prefill queue per replica, replies decoding beside it; each row runs again with"
        f" prefill at the rate where the reference's {ref.prefill_tokens:,} prefill tokens over the"
        f" {report.arrival_span_s:,.0f} s arrival span ({sum(ref.requests_per_replica) / report.arrival_span_s:.1f}"
        f" requests/s) keep the replicas {100 * report.busy:.0f}% busy"
        f" ({', '.join(sorted({f'{r.replicas}: {r.prefill_tokens_per_s:,.0f}' for r in report.results}))}"
        " tokens/s per replica); p95 wait and busy hit rate are that run's.",
        "",
        *table(headers, [_cells(report, r) for r in report.results]),
    ]
    return "\n".join(lines)


def save_plot(path: str, report: ClusterReport) -> None:
    """Hit rate against replicas (log2 axis), one line per policy, the reference as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator, ScalarFormatter

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r.policy for r in report.results if r.policy != "any"):
        # The 1-replica run ("any") starts every policy's line: with one replica they route alike.
        points = sorted((r.replicas, r.hit_rate) for r in report.results if r.policy in (policy, "any"))
        ax.plot([x for x, _ in points], [100 * y for _, y in points], marker="o", label=policy)
    ax.axhline(100 * report.reference.hit_rate, color="grey", linestyle="--", label="1 replica, whole trace")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r.replicas for r in report.results}))
    ax.xaxis.set_major_formatter(ScalarFormatter())  # 1, 2, 4, ... rather than powers of two
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("replicas")
    ax.set_ylabel("cluster prefix hit rate (%)")
    t = report.trace
    ax.set_title(f"{t.swarms} swarms x {t.agents} agents, {size(report.replica_kv_bytes)} KV per replica")
    ax.set_ylim(0, 100)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_replicas(text: str) -> list[int]:
    """ "1,2,4" -> [1, 2, 4]; ValueError on anything that is not a list of replica counts >= 1."""
    return parse_counts(text, "--replicas", 1, "replica counts")


def parse_policies(text: str) -> list[Policy]:
    """ "prefix,round-robin" -> the policies; ValueError on a name the router does not know."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if not names or unknown:
        raise ValueError(f"--router-policies wants some of {', '.join(POLICIES)}, got {text!r}")
    return [policy for policy in POLICIES if policy in names]


def replica_pages(text: str, page_bytes: int) -> int:
    """--replica-kv as pages: 'Npages', or a size rounded down to whole pages; at least one."""
    pages = int(text[: -len("pages")]) if text.endswith("pages") and text[:-5].isdigit() else None
    if pages is None:
        pages = parse_size(text) // page_bytes
    if pages < 1:
        raise ValueError(f"--replica-kv {text!r} holds no page of {page_bytes:,} bytes")
    return pages


def run_cluster(args: argparse.Namespace) -> int:
    """Replay the multi-swarm trace at each replica count and policy; print (and plot) hit rates."""
    counts, policies = parse_replicas(args.replicas), parse_policies(args.router_policies)
    given = [args.model, *(getattr(args, dest) for dest in KV_SHAPE_FLAGS.values())]
    per_token = FOUNDING_KV_BYTES_PER_TOKEN
    if any(value is not None for value in given):
        per_token = resolve_checkpoint(args).shape.kv_bytes_per_token
    if args.sim_page_size < 1:
        raise ValueError(f"--sim-page-size must be at least 1, got {args.sim_page_size}")
    pages = replica_pages(args.replica_kv, args.sim_page_size * per_token)
    if not 0.0 < args.sim_busy <= 1.0:
        raise ValueError(f"--sim-busy must be in (0, 1], got {args.sim_busy}")
    config = TraceConfig(
        args.swarms, args.agents, args.turns, args.head_tokens, seed=args.seed, shape=args.sim_trace
    )
    spec = ClusterSpec(
        1,
        pages,
        args.sim_page_size,
        min_match=args.route_min_match,
        imbalance=args.route_imbalance,
        retention=args.sim_retention,
    )
    if args.route_min_match < 0 or args.route_imbalance < 0:
        raise ValueError("--route-min-match and --route-imbalance must be >= 0")
    trace = make_trace(config)
    ref = reference(trace, spec)
    busy = (ref.prefill_tokens, args.sim_busy)
    results = tuple(sweep(trace, spec, counts, policies, busy, workers=args.sim_workers))
    report = ClusterReport(
        config,
        spec.page_size,
        pages,
        per_token,
        ref,
        results,
        spec.retention,
        args.sim_busy,
        arrival_span_s(trace),
    )
    print(json.dumps(to_json(report)) if args.json else report_text(report))
    if args.plot is not None:
        save_plot(args.plot, report)
    return 0
