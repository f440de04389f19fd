"""`swarmkv plan`: what N agents' copies of a shared prefix cost in KV, and what storing it once reclaims."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from swarmkv.engine.config import EngineConfig
from swarmkv.plan.measure import MeasuredRow, measure_rows
from swarmkv.plan.shape import Checkpoint, KVShape, element_bytes, load_checkpoint
from swarmkv.plan.table import AgentFit, PrefixRow, VramBudget, fit_agents, prefix_rows
from swarmkv.units import format_gib, parse_size

DEFAULT_PREFIXES = "1000,2000,3000,4000"


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand."""
    parser = subparsers.add_parser(
        "plan", help="KV cost of a shared prefix across N agents, and what sharing saves"
    )
    shape = parser.add_argument_group("KV shape (give --model, or --layers, --kv-heads and --head-dim)")
    shape.add_argument("--model", default=None, help="HF directory, config.json or GGUF file")
    shape.add_argument("--layers", type=int, default=None, help="attention layers that keep KV")
    shape.add_argument("--kv-heads", type=int, default=None, help="KV heads per layer")
    shape.add_argument("--head-dim", type=int, default=None, help="dimension of each head")
    shape.add_argument(
        "--dtype", default="float16", help="KV dtype: float16, bfloat16, float32, float8_e4m3fn, ..."
    )
    shape.add_argument(
        "--state-dtype", default=None, help="hybrid models' recurrent state dtype (default --dtype)"
    )
    parser.add_argument("--agents", type=int, default=8, help="agents sharing the prefix (default 8)")
    parser.add_argument("--prefix-tokens", default=DEFAULT_PREFIXES, help="comma-separated prefix lengths")
    parser.add_argument(
        "--vram", default=None, help="card memory, e.g. 16GiB: also report how many agents fit"
    )
    parser.add_argument("--weights", default=None, help="weights size (default: read from --model)")
    parser.add_argument(
        "--context", type=int, default=8192, help="tokens per agent for the fit (default 8192)"
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        help=f"tokens per KV page (default {EngineConfig.block_size}, the engine's)",
    )
    parser.add_argument("--measure", action="store_true", help="also count pages through the real allocator")
    parser.add_argument(
        "--tail-tokens", type=int, default=100, help="each agent's private tail for --measure"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object, all figures in bytes")
    parser.set_defaults(run=run)


def parse_prefixes(text: str) -> list[int]:
    """ "1000,2000" -> [1000, 2000]; ValueError on anything that is not a list of token counts >= 0."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise ValueError(f"--prefix-tokens wants comma-separated integers, got {text!r}") from exc
    if not values or min(values) < 0:
        raise ValueError(f"--prefix-tokens wants token counts >= 0, got {text!r}")
    return values


def resolve_checkpoint(args: argparse.Namespace) -> tuple[KVShape, int | None]:
    """The KV shape, and the weights' bytes when a checkpoint was read."""
    flags = {"--layers": args.layers, "--kv-heads": args.kv_heads, "--head-dim": args.head_dim}
    given = [name for name, value in flags.items() if value is not None]
    if args.model is not None:
        if given:
            raise ValueError(
                f"give --model or {', '.join(flags)}, not both ({', '.join(given)} with --model)"
            )
        checkpoint: Checkpoint = load_checkpoint(args.model, args.dtype, args.state_dtype)
        return checkpoint.shape, checkpoint.weights_bytes
    if len(given) != len(flags):
        missing = [name for name in flags if name not in given]
        raise ValueError(f"no KV shape: give --model, or {', '.join(flags)} (missing {', '.join(missing)})")
    layers = int(args.layers)
    shape = KVShape(layers, layers, int(args.kv_heads), int(args.head_dim), args.dtype)
    return shape, None


def run(args: argparse.Namespace) -> int:
    """Compute the table (and the fit, and the measurement), print it."""
    prefixes = parse_prefixes(args.prefix_tokens)
    shape, checkpoint_weights = resolve_checkpoint(args)
    rows = prefix_rows(shape.kv_bytes_per_token, args.agents, prefixes)
    budget = None
    if args.vram is not None:
        weights = parse_size(args.weights) if args.weights is not None else checkpoint_weights
        if weights is None:
            raise ValueError(
                "--vram needs the weights' size: pass --weights SIZE (or a --model with its weights)"
            )
        budget = VramBudget(parse_size(args.vram), weights, args.context, args.block_size)
    fits = [fit_agents(shape, budget, p) for p in prefixes] if budget else None
    measured = (
        measure_rows(shape, args.agents, prefixes, args.block_size, args.tail_tokens)
        if args.measure
        else None
    )
    result = Plan(shape, args.agents, rows, budget, fits, measured)
    print(json.dumps(to_json(result)) if args.json else report(result))
    for problem in result.problems:
        print(f"swarmkv plan: measured and formula disagree: {problem}", file=sys.stderr)
    return 1 if result.problems else 0


@dataclass(frozen=True)
class Plan:
    """Everything one `plan` run computed: the table, and the fit and measurement when asked for."""

    shape: KVShape
    num_agents: int
    rows: list[PrefixRow]
    budget: VramBudget | None
    fits: list[AgentFit] | None
    measured: list[MeasuredRow] | None

    @property
    def problems(self) -> list[str]:
        """Measured figures that fall outside the tolerance of the formula's."""
        pairs = zip(self.measured, self.rows, strict=True) if self.measured else ()
        return [f"{m.prefix_tokens} tokens: {d}" for m, row in pairs for d in m.disagreements(row)]


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
    if plan.budget is not None and plan.fits is not None:
        out["fit"] = plan.budget.to_json()
        for row, fit in zip(out["rows"], plan.fits, strict=True):
            row.update({k: v for k, v in fit.to_json().items() if k != "prefix_tokens"})
    if plan.measured:
        first, agrees = plan.measured[0], not plan.problems
        out["measured"] = {"block_size": first.block_size, "tail_tokens": first.tail_tokens, "agrees": agrees}
        for row, m in zip(out["rows"], plan.measured, strict=True):
            row["measured"] = m.to_json()
    return out


def _table(headers: Sequence[str], cells: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(line[i]) for line in cells)) for i, h in enumerate(headers)]
    return ["  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in [headers, *cells]]


def _row_cells(prefix_tokens: int, columns: dict[str, int]) -> list[str]:
    keys = ("kv_bytes_per_copy", "kv_bytes_all_copies", "kv_bytes_shared", "kv_bytes_reclaimed")
    return [f"{prefix_tokens:,}", *(format_gib(columns[k]) for k in keys)]


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
    if (budget := plan.budget) is not None and plan.fits is not None:
        out += [
            "",
            f"Fit in {format_gib(budget.vram_bytes)} of VRAM: weights {format_gib(budget.weights_bytes)} leave"
            f" {format_gib(budget.kv_budget_bytes)}; {budget.context_tokens:,}-token context per agent,"
            f" {budget.block_size}-token pages (KV and recurrent state only, no activations):",
        ]
        cells = [
            [f"{f.prefix_tokens:,}", str(f.agents_fit_per_slot), str(f.agents_fit_shared)] for f in plan.fits
        ]
        out += _table(["Prefix tokens", "Agents without sharing", "Agents with sharing"], cells)
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
        out.append(
            f"Tolerance: the formula is exact in tokens, pages round up; each measured figure must lie within"
            f" {n} pages (one per agent) of the formula: {'DISAGREES' if plan.problems else 'agrees'}."
        )
    return "\n".join(out)
