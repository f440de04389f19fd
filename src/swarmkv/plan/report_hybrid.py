"""The report's hybrid lines: the recurrent state per sequence, and the swarm's KV per-slot against shared KV
plus the state snapshot it resumes from, by the formula and as the allocator measured it."""

from __future__ import annotations

from typing import Any

from swarmkv.kv.state_index import MIN_SNAPSHOT_TOKENS
from swarmkv.plan.hybrid import HybridRow
from swarmkv.plan.layout import size, table
from swarmkv.plan.measure import MeasuredRow
from swarmkv.plan.shape import KVShape, RecurrentState

HEADERS = [
    "Prefix tokens",
    "Per-slot KV",
    "Shared KV",
    "Snapshots",
    "Shared + snapshots",
    "Per-slot / shared",
]


def state_json(shape: KVShape, rec: RecurrentState, num_agents: int) -> dict[str, Any]:
    """The `hybrid` object of `--json`: the layer split and the state's elements, dtypes and bytes."""
    return {
        "num_layers": shape.num_layers,
        "num_full_attention_layers": shape.num_kv_layers,
        "num_linear_attention_layers": rec.num_layers,
        "conv_elements_per_layer": rec.conv_elements_per_layer,
        "ssm_elements_per_layer": rec.ssm_elements_per_layer,
        "conv_dtype": rec.conv_dtype,
        "ssm_dtype": rec.ssm_dtype,
        "state_bytes_per_sequence": rec.bytes_per_sequence,
        "state_bytes_all_agents": num_agents * rec.bytes_per_sequence,
        "min_snapshot_tokens": MIN_SNAPSHOT_TOKENS,
    }


def state_lines(shape: KVShape, rec: RecurrentState) -> list[str]:
    """What the linear-attention layers keep instead of KV, and when a hybrid shares a prefix."""
    return [
        f"Hybrid model: KV counted only for the {shape.num_kv_layers} full-attention layers of {shape.num_layers};"
        f" the {rec.num_layers} linear-attention layers keep a constant recurrent state instead:"
        f" {rec.bytes_per_sequence / 2**20:.2f} MiB per sequence (per layer {rec.conv_elements_per_layer:,}"
        f" conv-window elements at {rec.conv_dtype} + {rec.ssm_elements_per_layer:,} matrix elements at"
        f" {rec.ssm_dtype}). Every running agent holds one; sharing a prefix also keeps a snapshot of it at"
        f" the prefix's end for the other agents to resume from, and no prefix under {MIN_SNAPSHOT_TOKENS}"
        " tokens is snapshotted, so none that short is shared."
    ]


def _cells(prefix_tokens: int, columns: dict[str, Any], state_bytes: int) -> list[str]:
    shared = columns["kv_bytes_shared_total"] + columns["snapshot_bytes"]
    return [
        f"{prefix_tokens:,}",
        size(columns["kv_bytes_per_slot_total"]),
        size(columns["kv_bytes_shared_total"]),
        f"{columns['num_snapshots']} x {size(state_bytes)}",
        size(shared),
        f"{columns['kv_bytes_per_slot_total'] / shared:.2f}x",
    ]


def formula_lines(rows: list[HybridRow], state_bytes: int) -> list[str]:
    """Per prefix: per-slot KV, shared KV, snapshots, their sum and the ratio; then the running states."""
    first = rows[0]
    n, tail = first.num_agents, first.tail_tokens
    lines = [
        "",
        f"{n} agents x (prefix + {tail:,}-token private tail), all of their KV and state snapshots: per-slot,"
        f" each stores its whole prompt; shared, the prefix's KV once and one snapshot of the state at its"
        f" end, which the other {n - 1} resume from:",
    ]
    lines += table(HEADERS, [_cells(r.prefix_tokens, r.to_json(), state_bytes) for r in rows])
    lines.append(
        f"Besides, both layouts hold a running state per agent: {n} x {size(state_bytes)} ="
        f" {size(first.running_state_bytes)}, left out of the ratio."
    )
    return lines


def measured_lines(measured: list[MeasuredRow]) -> list[str]:
    """The same figures from the allocator's pages in use and state slots."""
    state_bytes = measured[0].state_bytes
    lines = [
        "",
        "The same runs' whole KV (every page in use) and state slots (running + snapshots):",
    ]
    headers = [*HEADERS, "Pages (per-slot/shared/tails)", "Slots (per-slot/shared)"]
    cells = [
        [
            *_cells(m.prefix_tokens, m.hybrid_columns(), state_bytes),
            f"{m.pages_per_slot_total}/{m.pages_shared_total}/{m.pages_shared_total - m.pages_shared}",
            f"{m.num_running_per_slot}+{m.num_snapshots_per_slot}/{m.num_running}+{m.num_snapshots}",
        ]
        for m in measured
    ]
    return lines + table(headers, cells)
