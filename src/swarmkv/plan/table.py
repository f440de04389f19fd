"""The planner's arithmetic: a prefix's KV per copy, for N copies, stored once, and how many agents fit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from swarmkv.kv.page_pool import pages_for
from swarmkv.plan.shape import KVShape
from swarmkv.units import format_gib


@dataclass(frozen=True)
class PrefixRow:
    """One line of the table, exact in tokens (no page rounding), all in bytes."""

    prefix_tokens: int
    kv_bytes_per_copy: int
    kv_bytes_all_copies: int
    kv_bytes_shared: int
    kv_bytes_reclaimed: int

    def to_json(self) -> dict[str, Any]:
        """The row as the `--json` output writes it."""
        return asdict(self)


def prefix_row(
    kv_bytes_per_token: int, num_agents: int, prefix_tokens: int, shared: bool = True
) -> PrefixRow:
    """N agents each holding the prefix versus one shared copy: the reclaim is N - 1 copies. A prefix the
    layout cannot share (`shared` False: a hybrid's prefix too short to snapshot) stays N copies."""
    if num_agents <= 0:
        raise ValueError(f"--agents must be a positive integer, got {num_agents}")
    if prefix_tokens < 0:
        raise ValueError(f"prefix lengths must be >= 0 tokens, got {prefix_tokens}")
    per_copy = prefix_tokens * kv_bytes_per_token
    copies = 1 if shared else num_agents
    return PrefixRow(
        prefix_tokens=prefix_tokens,
        kv_bytes_per_copy=per_copy,
        kv_bytes_all_copies=num_agents * per_copy,
        kv_bytes_shared=copies * per_copy,
        kv_bytes_reclaimed=(num_agents - copies) * per_copy,
    )


def prefix_rows(shape: KVShape, num_agents: int, prefix_tokens: Sequence[int]) -> list[PrefixRow]:
    """One row per prefix length, in the order given."""
    per_token = shape.kv_bytes_per_token
    return [prefix_row(per_token, num_agents, p, shape.shares_prefix(p)) for p in prefix_tokens]


@dataclass(frozen=True)
class VramBudget:
    """The card, the weights and the runtime reserve on it, and what each agent needs: `context_tokens`
    in pages of `block_size`."""

    vram_bytes: int
    weights_bytes: int
    context_tokens: int
    block_size: int
    runtime_reserve_bytes: int = 0  # activations, logits, workspace: 0 when the shape is not known

    def __post_init__(self) -> None:
        if self.context_tokens <= 0 or self.block_size <= 0:
            raise ValueError(
                f"--context and --block-size must be positive, got {self.context_tokens} and {self.block_size}"
            )
        if self.weights_bytes < 0:
            raise ValueError(f"--weights must be >= 0 bytes, got {self.weights_bytes}")
        weights, reserve, vram = self.weights_bytes, self.runtime_reserve_bytes, self.vram_bytes
        if weights >= vram:
            raise ValueError(
                f"--vram {format_gib(vram)} is smaller than the weights ({format_gib(weights)}) by"
                f" {format_gib(weights - vram)} ({weights - vram:,} bytes), before the runtime reserve"
                f" ({format_gib(reserve)}) and any KV"
            )
        if weights + reserve >= vram:
            raise ValueError(
                f"--vram {format_gib(vram)} holds the weights ({format_gib(weights)}) but not the runtime"
                f" reserve ({format_gib(reserve)}) besides: {format_gib(weights + reserve - vram)}"
                f" ({weights + reserve - vram:,} bytes) short, with nothing left for KV"
            )

    @property
    def kv_budget_bytes(self) -> int:
        """VRAM left for KV pages and recurrent state once the weights and the runtime reserve are counted."""
        return self.vram_bytes - self.weights_bytes - self.runtime_reserve_bytes

    def to_json(self) -> dict[str, Any]:
        """The budget as the `--json` output writes it."""
        return {**asdict(self), "kv_budget_bytes": self.kv_budget_bytes}


@dataclass(frozen=True)
class AgentFit:
    """How many agents of one context length fit, each holding its own prefix or sharing one copy."""

    prefix_tokens: int
    agents_fit_per_slot: int
    agents_fit_shared: int
    agent_bytes_per_slot: int  # one agent's whole context in pages, plus its recurrent state
    agent_bytes_private: int  # one sharing agent's own pages (its tail), plus its recurrent state
    prefix_bytes_shared: int  # the prefix's full pages, held once for every agent
    snapshot_bytes_shared: int = 0  # hybrids: the state snapshot at the prefix's end they resume from

    def to_json(self) -> dict[str, Any]:
        """The fit as the `--json` output writes it."""
        return asdict(self)


def fit_agents(shape: KVShape, budget: VramBudget, prefix_tokens: int) -> AgentFit:
    """Agents that fit in the KV budget; pages as the radix cache shares them (full prefix pages only), and
    for a hybrid one state snapshot at the prefix's end besides (no sharing when it is too short for one)."""
    if budget.context_tokens <= prefix_tokens:
        raise ValueError(
            f"--context ({budget.context_tokens} tokens) must be longer than the prefix ({prefix_tokens} tokens)"
        )
    bs = budget.block_size
    page_bytes = bs * shape.kv_bytes_per_token
    state = shape.state_bytes_per_sequence
    context_pages = pages_for(budget.context_tokens, bs)
    # A prefix that ends mid-page shares only its full pages: the boundary page also holds the
    # agent's own tokens, so every agent keeps a private copy of it.
    shared = shape.shares_prefix(prefix_tokens)
    shared_pages = prefix_tokens // bs if shared else 0
    snapshot = state if shared else 0
    agent_per_slot = context_pages * page_bytes + state
    agent_private = (context_pages - shared_pages) * page_bytes + state
    prefix_bytes = shared_pages * page_bytes
    room = budget.kv_budget_bytes - snapshot
    return AgentFit(
        prefix_tokens=prefix_tokens,
        agents_fit_per_slot=budget.kv_budget_bytes // agent_per_slot,
        agents_fit_shared=(room - prefix_bytes) // agent_private if room >= prefix_bytes else 0,
        agent_bytes_per_slot=agent_per_slot,
        agent_bytes_private=agent_private,
        prefix_bytes_shared=prefix_bytes,
        snapshot_bytes_shared=snapshot,
    )
