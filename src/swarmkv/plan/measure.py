"""`plan --measure`: push N agents through the engine core (its scheduler and KV manager), count the pages, and
for a hybrid model the state slots: the snapshots sharing keeps and the running states both layouts hold."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from swarmkv.core.config import EngineConfig
from swarmkv.core.core import EngineCore
from swarmkv.kv import pages_for
from swarmkv.plan.hybrid import HybridRow
from swarmkv.plan.shape import KV_DTYPES, KVShape, RecurrentState
from swarmkv.plan.table import PrefixRow


@dataclass(frozen=True)
class MeasuredRow:
    """Pages the real allocator used for one prefix length, beside the formula's exact bytes.

    Tolerance: the formula is exact in tokens, the pool hands out whole pages. Each agent's page
    table rounds its prefix up to at most one partly filled page, and the radix cache shares only
    full pages, so every measured figure is within `num_agents` pages of the formula (strictly less).
    A hybrid's shared KV is the prefix's pages plus the tails' (the pages past them), each checked so;
    its snapshots and running states are counted in slots and must match exactly. Pages count when in
    use: the snapshot's cached copy of a page the prefix ends inside is cache, evictable, left out.
    """

    prefix_tokens: int
    num_agents: int
    block_size: int
    tail_tokens: int
    page_bytes: int
    pages_per_copy: int  # pages covering agent 0's prefix
    pages_all_copies: int  # distinct pages covering the prefix, summed over agents, in the per-slot layout
    pages_shared: int  # distinct pages covering the prefix across all agents, with the radix cache
    pages_per_slot_total: int  # every page in use in the per-slot layout (prefixes and tails)
    pages_shared_total: int  # every page in use with the radix cache
    state_bytes: int = 0  # hybrids: one state slot of the engine's layout
    num_state_slots: int = 0  # hybrids: the state pool of each run's manager
    num_snapshots: int = 0  # state snapshots kept in the shared run
    num_running: int = 0  # running states held in the shared run
    num_snapshots_per_slot: int = 0
    num_running_per_slot: int = 0

    @property
    def pages_reclaimed(self) -> int:
        """Pages the radix cache saves over the per-slot layout."""
        return self.pages_per_slot_total - self.pages_shared_total

    @property
    def tolerance_bytes(self) -> int:
        """How far a measured figure may sit from the formula: one page per agent."""
        return self.num_agents * self.page_bytes

    def columns(self) -> dict[str, int]:
        """Measured bytes, keyed like the formula's PrefixRow fields."""
        return {
            "kv_bytes_per_copy": self.pages_per_copy * self.page_bytes,
            "kv_bytes_all_copies": self.pages_all_copies * self.page_bytes,
            "kv_bytes_shared": self.pages_shared * self.page_bytes,
            "kv_bytes_reclaimed": self.pages_reclaimed * self.page_bytes,
        }

    def hybrid_columns(self) -> dict[str, int]:
        """Measured figures keyed like the formula's HybridRow fields (bytes, and the snapshot count)."""
        return {
            "kv_bytes_per_slot_total": self.pages_per_slot_total * self.page_bytes,
            "kv_bytes_tails": (self.pages_shared_total - self.pages_shared) * self.page_bytes,
            "kv_bytes_shared_total": self.pages_shared_total * self.page_bytes,
            "num_snapshots": self.num_snapshots,
            "snapshot_bytes": self.num_snapshots * self.state_bytes,
            "running_state_bytes": self.num_running * self.state_bytes,
        }

    def disagreements(self, formula: PrefixRow, hybrid: HybridRow | None = None) -> list[str]:
        """Figures where measurement and formula differ by the tolerance or more, or at all for state slots
        (empty when they agree). The shared total is not checked itself: it is the prefix plus the tails."""
        expected = formula.to_json()
        found = [
            f"{name}: measured {value:,} B, formula {expected[name]:,} B"
            for name, value in self.columns().items()
            if abs(value - expected[name]) >= self.tolerance_bytes
        ]
        if hybrid is None:
            return found
        expected, measured = hybrid.to_json(), self.hybrid_columns()
        for name in ("kv_bytes_per_slot_total", "kv_bytes_tails"):
            if abs(measured[name] - expected[name]) >= self.tolerance_bytes:
                found.append(f"{name}: measured {measured[name]:,} B, formula {expected[name]:,} B")
        for name in ("num_snapshots", "snapshot_bytes", "running_state_bytes"):
            if measured[name] != expected[name]:
                found.append(f"{name}: measured {measured[name]:,}, formula {expected[name]:,}")
        per_slot = (self.num_snapshots_per_slot, self.num_running_per_slot * self.state_bytes)
        if per_slot != (0, hybrid.running_state_bytes):
            found.append(
                f"per-slot state slots: {self.num_snapshots_per_slot} snapshots (none expected),"
                f" {self.num_running_per_slot} running (formula {self.num_agents})"
            )
        return found

    def to_json(self) -> dict[str, Any]:
        """The measurement as the `--json` output writes it."""
        pages = {
            "pages_per_copy": self.pages_per_copy,
            "pages_all_copies": self.pages_all_copies,
            "pages_shared": self.pages_shared,
            "pages_reclaimed": self.pages_reclaimed,
            "pages_per_slot_total": self.pages_per_slot_total,
            "pages_shared_total": self.pages_shared_total,
        }
        out: dict[str, Any] = {
            **self.columns(),
            **pages,
            "page_bytes": self.page_bytes,
            "tolerance_bytes": self.tolerance_bytes,
        }
        if self.state_bytes:
            columns = self.hybrid_columns()
            shared = columns["kv_bytes_shared_total"] + columns["snapshot_bytes"]
            out["hybrid"] = {
                **columns,
                "shared_bytes": shared,
                "ratio": columns["kv_bytes_per_slot_total"] / shared,
                "state_bytes": self.state_bytes,
                "num_state_slots": self.num_state_slots,
                "num_running": self.num_running,
                "num_snapshots_per_slot": self.num_snapshots_per_slot,
                "num_running_per_slot": self.num_running_per_slot,
            }
        return out


def agent_sequences(num_agents: int, prefix_tokens: int, tail_tokens: int) -> list[list[int]]:
    """Deterministic token ids: one prefix for all, then a tail no other agent shares."""
    prefix = list(range(prefix_tokens))
    return [
        prefix + list(range(prefix_tokens + a * tail_tokens, prefix_tokens + (a + 1) * tail_tokens))
        for a in range(num_agents)
    ]


def admit(core: EngineCore, sequences: Sequence[Sequence[int]]) -> list[list[int]]:
    """Run each agent's prompt through the engine core, all queued at once, until its KV is computed (no
    model: the measurement counts pages, not FLOPs); return their page tables. The agents stay running."""
    agents = [core.add_prompt(f"agent-{i}", list(tokens)) for i, tokens in enumerate(sequences)]
    assert all(core.compute_prompts(agents, finish=False)), "the measuring pool is too small for these agents"
    core.check_integrity()
    return [list(core.kv.page_table(seq.request_id)) for seq in agents]


def _core(
    num_agents: int, num_pages: int, block_size: int, prefix_caching: bool, num_state_slots: int
) -> EngineCore:
    """An engine core for the measurement: every agent running at once, each prompt in one step."""
    config = EngineConfig(
        block_size=block_size,
        prefix_caching=prefix_caching,
        max_num_seqs=num_agents,
        max_num_batched_tokens=1 << 30,
    )
    return EngineCore(config, num_pages, num_state_slots=num_state_slots)


def state_slot_bytes(recurrent: RecurrentState) -> int:
    """Bytes of one state slot in the engine's layout (swarmkv.engine.state_cache.StateCache), built on the
    meta device: per linear-attention layer the conv window [conv_dim, kernel - 1] and the matrices."""
    conv = torch.empty(
        (recurrent.num_layers, recurrent.conv_dim, recurrent.conv_kernel - 1),
        dtype=KV_DTYPES[recurrent.conv_dtype],
        device="meta",
    )
    ssm = torch.empty(
        (recurrent.num_layers, recurrent.num_value_heads, recurrent.key_head_dim, recurrent.value_head_dim),
        dtype=KV_DTYPES[recurrent.ssm_dtype],
        device="meta",
    )
    return conv.nbytes + ssm.nbytes


def _prefix_pages(tables: list[list[int]], prefix_tokens: int, block_size: int) -> list[set[int]]:
    num = pages_for(prefix_tokens, block_size)
    return [set(table[:num]) for table in tables]


def measure_row(
    shape: KVShape, num_agents: int, prefix_tokens: int, block_size: int, tail_tokens: int
) -> MeasuredRow:
    """Run the agents through the scheduler over a sharing and a per-slot KV manager; count their pages."""
    if min(num_agents, block_size, tail_tokens) <= 0:
        raise ValueError(
            f"--agents, --block-size and --tail-tokens must be positive, got {num_agents}, {block_size}, {tail_tokens}"
        )
    sequences = agent_sequences(num_agents, prefix_tokens, tail_tokens)
    num_pages = num_agents * pages_for(prefix_tokens + tail_tokens, block_size)
    # The engine's KV slab at this shape, on the meta device: the layout without the memory.
    slab = torch.empty(
        (shape.num_kv_layers, 2, num_pages, block_size, shape.num_kv_heads, shape.head_dim),
        dtype=KV_DTYPES[shape.dtype],
        device="meta",
    )
    page_bytes = slab.nbytes // num_pages
    assert page_bytes == block_size * shape.kv_bytes_per_token, (
        "slab layout disagrees with the per-token formula"
    )
    state_bytes, num_slots = 0, 0
    if shape.recurrent is not None:
        state_bytes = state_slot_bytes(shape.recurrent)
        assert state_bytes == shape.state_bytes_per_sequence, "state layout disagrees with the formula"
        num_slots = 2 * num_agents + 2  # a running state each, and room for every snapshot: none dropped
        num_pages += 1  # the snapshot's cached copy of the page the prefix ends in
    per_slot, shared = (
        _core(num_agents, num_pages, block_size, prefix_caching=False, num_state_slots=num_slots),
        _core(num_agents, num_pages, block_size, prefix_caching=True, num_state_slots=num_slots),
    )
    per_slot_prefixes = _prefix_pages(admit(per_slot, sequences), prefix_tokens, block_size)
    shared_prefixes = _prefix_pages(admit(shared, sequences), prefix_tokens, block_size)
    per_slot_states, shared_states = _state_counts(per_slot), _state_counts(shared)
    return MeasuredRow(
        prefix_tokens=prefix_tokens,
        num_agents=num_agents,
        block_size=block_size,
        tail_tokens=tail_tokens,
        page_bytes=page_bytes,
        pages_per_copy=len(per_slot_prefixes[0]),
        pages_all_copies=len(set().union(*per_slot_prefixes)),
        pages_shared=len(set().union(*shared_prefixes)),
        pages_per_slot_total=per_slot.kv.num_in_use,
        pages_shared_total=shared.kv.num_in_use,
        state_bytes=state_bytes,
        num_state_slots=num_slots,
        num_snapshots=shared_states[0],
        num_running=shared_states[1],
        num_snapshots_per_slot=per_slot_states[0],
        num_running_per_slot=per_slot_states[1],
    )


def _state_counts(core: EngineCore) -> tuple[int, int]:
    """(branch snapshots, running states) in the manager's state pool; (0, 0) without one. Each agent's
    prompt-end snapshot is its own state, which a per-slot engine keeps in its slot too: not counted."""
    states = core.kv.states.index
    return (states.count("branch"), states.num_running) if states is not None else (0, 0)


def measure_rows(
    shape: KVShape, num_agents: int, prefix_tokens: Sequence[int], block_size: int, tail_tokens: int
) -> list[MeasuredRow]:
    """One measurement per prefix length."""
    return [measure_row(shape, num_agents, p, block_size, tail_tokens) for p in prefix_tokens]
