"""What one `swarmkv plan` run computed, and its two renderings: the `--json` object and the printed report."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swarmkv.plan.measure import MeasuredRow
from swarmkv.plan.reserve import ACTIVATION_FACTOR, LOGITS_BYTES_PER_ELEMENT, RuntimeReserve
from swarmkv.plan.shape import KVShape, element_bytes
from swarmkv.plan.table import AgentFit, PrefixRow, VramBudget
from swarmkv.plan.weights import AGREEMENT_FRACTION, WeightsCheck, WeightsFigure
from swarmkv.units import format_gib


@dataclass(frozen=True)
class Plan:
    """Everything one `plan` run computed: the table, and the fit and measurements when asked for."""

    shape: KVShape
    num_agents: int
    rows: list[PrefixRow]
    budget: VramBudget | None = None
    fits: list[AgentFit] | None = None
    weights: WeightsFigure | None = None  # the figure the budget uses
    reserve: RuntimeReserve | None = None  # None when the model's dimensions are not known
    measured: list[MeasuredRow] | None = None
    weights_check: WeightsCheck | None = None
    config_problem: str | None = None  # why the weights could not be counted from a config, if not

    @property
    def problems(self) -> list[str]:
        """Measured figures that fall outside the tolerance of the formula's."""
        pairs = zip(self.measured, self.rows, strict=True) if self.measured else ()
        found = [f"{m.prefix_tokens} tokens: {d}" for m, row in pairs for d in m.disagreements(row)]
        check = self.weights_check
        if check is not None and not check.agrees:
            found.append(
                f"weights at {check.weight_format}: measured {check.measured_bytes:,} B,"
                f" formula {check.formula_bytes:,} B"
            )
        return found


def to_json(plan: Plan) -> dict[str, Any]:
    """The `--json` object: bytes throughout, fit and measurement only when asked for."""
    shape, num_agents = plan.shape, plan.num_agents
    out: dict[str, Any] = {"kv_bytes_per_token": shape.kv_bytes_per_token, "num_agents": num_agents}
    out["shape"] = {"layers": shape.num_kv_layers, "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim}
    out["shape"]["dtype"] = shape.dtype
    out["rows"] = [row.to_json() for row in plan.rows]
    if shape.recurrent is not None:
        rec = shape.recurrent
        out["hybrid"] = {
            "num_layers": shape.num_layers,
            "num_full_attention_layers": shape.num_kv_layers,
            "num_linear_attention_layers": rec.num_layers,
            "conv_elements_per_layer": rec.conv_elements_per_layer,
            "ssm_elements_per_layer": rec.ssm_elements_per_layer,
            "state_dtype": rec.dtype,
            "state_bytes_per_sequence": rec.bytes_per_sequence,
            "state_bytes_all_agents": num_agents * rec.bytes_per_sequence,
        }
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


def _table(headers: Sequence[str], cells: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(line[i]) for line in cells)) for i, h in enumerate(headers)]
    return ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in [headers, *cells]]


def _row_cells(prefix_tokens: int, columns: dict[str, int]) -> list[str]:
    keys = ("kv_bytes_per_copy", "kv_bytes_all_copies", "kv_bytes_shared", "kv_bytes_reclaimed")
    return [f"{prefix_tokens:,}", *(format_gib(columns[k]) for k in keys)]


def _size(num_bytes: int) -> str:
    """GiB from 1 GiB up, MiB below."""
    return format_gib(num_bytes) if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


Item = tuple[str, int, str]  # label, bytes, how the figure was made


def _breakdown(items: list[Item]) -> list[str]:
    """Labels left-aligned, sizes right-aligned, then each figure's arithmetic."""
    label_width = max(len(label) for label, _, _ in items)
    sizes = [_size(num_bytes) for _, num_bytes, _ in items]
    size_width = max(map(len, sizes))
    return [
        f"  {label.ljust(label_width)}  {size.rjust(size_width)}  {note}".rstrip()
        for (label, _, note), size in zip(items, sizes, strict=True)
    ]


def _weights_items(plan: Plan, weights: WeightsFigure) -> list[Item]:
    files = f"; the files hold {_size(weights.file_bytes)}" if weights.file_bytes is not None else ""
    if weights.source == "--weights":
        return [("weights", weights.num_bytes, f"as given by --weights{files}")]
    if weights.count is None:
        return [("weights", weights.num_bytes, f"the weight files' size ({plan.config_problem})")]
    count, dtype = weights.count, weights.count.dtype
    layout = {
        "int4": f"int4 in groups of 32, a {dtype} scale and minimum per group",
        "int8": f"int8, a {dtype} scale per output channel",
    }.get(count.weight_format, dtype)
    items = [
        (
            "weights",
            count.total_bytes,
            f"at {count.weight_format}, all but the projections in {dtype}{files}:",
        ),
        ("  projections", count.projections_bytes, f"{layout} (qkv, o, gate-up, down)"),
        ("  norms", count.norms_bytes, ""),
    ]
    if count.biases_bytes:
        items.append(("  QKV biases", count.biases_bytes, ""))
    if count.tied_embeddings:
        return [*items, ("  embedding", count.embedding_bytes, "also the LM head (tied)")]
    return [*items, ("  embedding", count.embedding_bytes, ""), ("  LM head", count.lm_head_bytes, "")]


def _reserve_items(plan: Plan) -> list[Item]:
    reserve = plan.reserve
    if reserve is None:
        return [("runtime reserve", 0, f"not counted: {plan.config_problem}")]
    r = reserve
    return [
        ("runtime reserve", r.total_bytes, "besides weights and KV:"),
        (
            "  activations",
            r.activation_bytes,
            f"{r.max_num_batched_tokens:,} batched tokens x {r.activation_width:,} (hidden + qkv + 2 x"
            f" intermediate) x {r.activation_element_bytes} B x {ACTIVATION_FACTOR}",
        ),
        (
            "  logits",
            r.logits_bytes,
            f"{r.vocab_size:,} vocab x {r.max_num_seqs} sampled rows x {LOGITS_BYTES_PER_ELEMENT} B",
        ),
        ("  rotary table", r.rotary_bytes, f"cos and sin for {r.rotary_positions:,} positions, float32"),
        (
            "  workspace",
            r.workspace_bytes,
            "CUDA context, cuBLAS/Triton workspaces, CUDA graphs (--workspace)",
        ),
    ]


def _fit_lines(plan: Plan, budget: VramBudget, fits: list[AgentFit], weights: WeightsFigure) -> list[str]:
    shape = plan.shape
    per_slot = fits[0]
    kv = "KV pages and recurrent state" if shape.recurrent else "KV pages"
    items = [
        *_weights_items(plan, weights),
        *_reserve_items(plan),
        ("KV budget", budget.kv_budget_bytes, f"what is left for {kv}"),
    ]
    lines = [
        "",
        f"Fit in {format_gib(budget.vram_bytes)} of VRAM, KV at {shape.dtype}"
        f" ({shape.kv_bytes_per_token / 1024:.2f} KiB per token), {budget.context_tokens:,}-token context per"
        f" agent in {budget.block_size}-token pages:",
        *_breakdown(items),
        f"Agents that fit: {per_slot.agents_fit_per_slot} per-slot (each stores its whole context,"
        f" {_size(per_slot.agent_bytes_per_slot)}); shared, each prefix's full pages are stored once:",
    ]
    cells = [[f"{f.prefix_tokens:,}", str(f.agents_fit_per_slot), str(f.agents_fit_shared)] for f in fits]
    return lines + _table(["Prefix tokens", "Agents per-slot", "Agents shared"], cells)


def _weights_check_lines(plan: Plan) -> list[str]:
    check = plan.weights_check
    if check is None:
        return [f"Weights not checked: {plan.config_problem}"]
    share = abs(check.difference_bytes) / check.formula_bytes if check.formula_bytes else 0.0
    verdict = "agrees" if check.agrees else "DISAGREES"
    return [
        f"Weights: the model built at {check.weight_format} on the meta device holds {check.measured_bytes:,} B"
        f" in parameters and buffers; the formula counts {check.formula_bytes:,} B: difference"
        f" {check.difference_bytes:+,} B ({share:.3%}), within {AGREEMENT_FRACTION:.0%}: {verdict}."
    ]


def report(plan: Plan) -> str:
    """The human-readable report: the shape, the table, then the fit and the measurement if asked for."""
    shape, n = plan.shape, plan.num_agents
    per_token = shape.kv_bytes_per_token
    out = [
        f"KV per token: {per_token:,} bytes ({per_token / 1024:.2f} KiB) = 2 (K, V) x {shape.num_kv_layers} layers"
        f" x {shape.num_kv_heads} KV heads x head dim {shape.head_dim} x {element_bytes(shape.dtype)} bytes"
        f" ({shape.dtype})"
    ]
    if (rec := shape.recurrent) is not None:
        out.append(
            f"Hybrid model: KV counted only for the {shape.num_kv_layers} full-attention layers of {shape.num_layers};"
            f" the {rec.num_layers} linear-attention layers keep a constant recurrent state instead:"
            f" {rec.bytes_per_sequence / 2**20:.2f} MiB per sequence ({rec.conv_elements_per_layer:,} conv +"
            f" {rec.ssm_elements_per_layer:,} SSM elements per layer, {rec.dtype}), never shared, so"
            f" {n} agents hold {format_gib(n * rec.bytes_per_sequence)} of it either way."
        )
    if shape.num_sliding_layers:
        out.append(
            f"Note: {shape.num_sliding_layers} sliding-window layers counted as full attention (exact up to the window)."
        )
    headers = ["Prefix tokens", "KV per copy", f"{n} copies", "One shared copy", "Reclaimed"]
    out += ["", f"{n} agents, each opening with the same prefix:"]
    out += _table(headers, [_row_cells(r.prefix_tokens, r.to_json()) for r in plan.rows])
    if plan.budget is not None and plan.fits is not None and plan.weights is not None:
        out += _fit_lines(plan, plan.budget, plan.fits, plan.weights)
    if plan.measured:
        first = plan.measured[0]
        out += [
            "",
            f"Measured: the engine's scheduler over its KV manager, per-slot and shared, {n} agents x"
            f" (prefix + {first.tail_tokens}-token private tail), pages of {first.page_bytes:,} bytes"
            + (" (KV pages only: the recurrent state is per sequence either way):" if rec else ":"),
        ]
        cells = [
            [
                *_row_cells(m.prefix_tokens, m.columns()),
                f"{m.pages_per_copy}/{m.pages_all_copies}/{m.pages_shared}/{m.pages_reclaimed}",
            ]
            for m in plan.measured
        ]
        out += _table([*headers, "Pages (copy/all/shared/reclaimed)"], cells)
        pages_disagree = any(m.disagreements(row) for m, row in zip(plan.measured, plan.rows, strict=True))
        out.append(
            f"Tolerance: the formula is exact in tokens, pages round up; each measured figure must lie within"
            f" {n} pages (one per agent) of the formula: {'DISAGREES' if pages_disagree else 'agrees'}."
        )
        out += _weights_check_lines(plan)
    return "\n".join(out)
