"""The two renderings of a `swarmkv plan` run: the `--json` object and the printed report."""

from __future__ import annotations

from typing import Any

from swarmkv.plan import report_hybrid
from swarmkv.plan.layout import table
from swarmkv.plan.report_fit import fit_lines, weights_check_lines
from swarmkv.plan.report_gguf import gguf_lines
from swarmkv.plan.result import Plan
from swarmkv.plan.shape import element_bytes
from swarmkv.units import format_gib


def to_json(plan: Plan) -> dict[str, Any]:
    """The `--json` object: bytes throughout, fit and measurement only when asked for."""
    shape, num_agents = plan.shape, plan.num_agents
    out: dict[str, Any] = {"kv_bytes_per_token": shape.kv_bytes_per_token, "num_agents": num_agents}
    out["shape"] = {"layers": shape.num_kv_layers, "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim}
    out["shape"]["dtype"] = shape.dtype
    out["rows"] = [row.to_json() for row in plan.rows]
    if plan.gguf_weights is not None:
        out["gguf_weights"] = plan.gguf_weights.to_json()
    if shape.recurrent is not None:
        out["hybrid"] = report_hybrid.state_json(shape, shape.recurrent, num_agents)
    for row, hybrid in zip(out["rows"], plan.hybrid or (), strict=False):
        row["hybrid"] = hybrid.to_json()
    if plan.budget is not None and plan.fits is not None and plan.weights is not None:
        fit = {**plan.budget.to_json(), **plan.weights.to_json()}
        fit["runtime_reserve"] = plan.reserve.to_json() if plan.reserve is not None else None
        fit["kv_dtype"], fit["kv_bytes_per_token"] = shape.dtype, shape.kv_bytes_per_token
        # Per-slot, every agent stores its whole context whatever the prefix; sharing depends on it.
        fit["agents_fit_per_slot"] = plan.fits[0].agents_fit_per_slot
        fit["prefix_tokens"] = [f.prefix_tokens for f in plan.fits]
        fit["agents_fit_shared"] = [f.agents_fit_shared for f in plan.fits]
        out["fit"] = fit
        for row, agent_fit in zip(out["rows"], plan.fits, strict=True):
            row.update({k: v for k, v in agent_fit.to_json().items() if k != "prefix_tokens"})
    if plan.measured is not None:
        first = plan.measured[0]
        out["measured"] = {"block_size": first.block_size, "tail_tokens": first.tail_tokens}
        out["measured"]["agrees"] = not plan.problems
        out["measured"]["weights"] = plan.weights_check.to_json() if plan.weights_check else None
        for row, m in zip(out["rows"], plan.measured, strict=True):
            row["measured"] = m.to_json()
    return out


def _row_cells(prefix_tokens: int, columns: dict[str, int]) -> list[str]:
    keys = ("kv_bytes_per_copy", "kv_bytes_all_copies", "kv_bytes_shared", "kv_bytes_reclaimed")
    return [f"{prefix_tokens:,}", *(format_gib(columns[k]) for k in keys)]


def _measured_lines(plan: Plan) -> list[str]:
    assert plan.measured
    n, first, hybrid = plan.num_agents, plan.measured[0], plan.shape.recurrent is not None
    out = [
        "",
        f"Measured: the engine's scheduler over its KV manager, per-slot and shared, {n} agents x"
        f" (prefix + {first.tail_tokens}-token private tail), pages of {first.page_bytes:,} bytes"
        + (f", {first.num_state_slots} state slots:" if hybrid else ":"),
    ]
    headers = ["Prefix tokens", "KV per copy", f"{n} copies", "One shared copy", "Reclaimed"]
    cells = [
        [
            *_row_cells(m.prefix_tokens, m.columns()),
            f"{m.pages_per_copy}/{m.pages_all_copies}/{m.pages_shared}/{m.pages_reclaimed}",
        ]
        for m in plan.measured
    ]
    out += table([*headers, "Pages (copy/all/shared/reclaimed)"], cells)
    if hybrid:
        out += report_hybrid.measured_lines(plan.measured)
    verdict = "DISAGREES" if plan.measured_disagreements() else "agrees"
    parts = (
        " (the shared KV in its two parts: the prefix's pages and the pages past them), and the state"
        " slots must match it exactly"
        if hybrid
        else ""
    )
    out.append(
        f"Tolerance: the formula is exact in tokens, pages round up; each measured figure must lie within"
        f" {n} pages (one per agent) of the formula{parts}: {verdict}."
    )
    return out + weights_check_lines(plan)


def report(plan: Plan) -> str:
    """The human-readable report: the shape, the table, then the fit and the measurement if asked for."""
    shape, n = plan.shape, plan.num_agents
    per_token = shape.kv_bytes_per_token
    out = [
        f"KV per token: {per_token:,} bytes ({per_token / 1024:.2f} KiB) = 2 (K, V) x {shape.num_kv_layers} layers"
        f" x {shape.num_kv_heads} KV heads x head dim {shape.head_dim} x {element_bytes(shape.dtype)} bytes"
        f" ({shape.dtype})"
    ]
    if shape.recurrent is not None:
        out += report_hybrid.state_lines(shape, shape.recurrent)
    if shape.num_sliding_layers:
        out.append(
            f"Note: {shape.num_sliding_layers} sliding-window layers counted as full attention (exact up to the window)."
        )
    if plan.gguf_weights is not None:
        out += gguf_lines(plan.gguf_weights)
    headers = ["Prefix tokens", "KV per copy", f"{n} copies", "One shared copy", "Reclaimed"]
    out += ["", f"{n} agents, each opening with the same prefix:"]
    out += table(headers, [_row_cells(r.prefix_tokens, r.to_json()) for r in plan.rows])
    if plan.hybrid:
        out += report_hybrid.formula_lines(plan.hybrid, shape.state_bytes_per_sequence)
    if plan.budget is not None and plan.fits is not None and plan.weights is not None:
        out += fit_lines(plan, plan.budget, plan.fits, plan.weights)
    if plan.measured:
        out += _measured_lines(plan)
    return "\n".join(out)
