"""A hybrid swarm's whole footprint: per-slot, every agent's prefix and tail in KV; shared, the prefix's KV
once, the tails, and the one state snapshot the other agents resume from."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from swarmkv.plan.shape import KVShape


@dataclass(frozen=True)
class HybridRow:
    """N agents of one common prefix and a private tail each on a hybrid model: exact in tokens, in bytes.

    Per-slot, every agent computes and stores the whole prefix. Shared, the engine computes it once, cuts the
    prefill where the agents part, snapshots the recurrent state there, and the other agents resume from the
    snapshot (no snapshot, no sharing: a prefix under MIN_SNAPSHOT_TOKENS, or a single agent). Both layouts
    hold one running state per agent besides: `running_state_bytes`, left out of the ratio.
    """

    prefix_tokens: int
    tail_tokens: int
    num_agents: int
    kv_bytes_per_slot_total: int  # agents x (prefix + tail) tokens of KV
    kv_bytes_tails: int  # agents x tail tokens of KV
    kv_bytes_shared_total: int  # the prefix once (when snapshotted) and every tail
    num_snapshots: int  # states kept at the prefix's end for the agents that resume there: 1, or 0
    snapshot_bytes: int
    running_state_bytes: int  # agents x state bytes, alike in both layouts

    @property
    def shared_bytes(self) -> int:
        """What sharing stores: the shared layout's KV plus its snapshots."""
        return self.kv_bytes_shared_total + self.snapshot_bytes

    @property
    def ratio(self) -> float:
        """Per-slot KV over shared KV plus snapshots: how many times less sharing stores."""
        return self.kv_bytes_per_slot_total / self.shared_bytes

    def to_json(self) -> dict[str, Any]:
        """The row as the `--json` output writes it."""
        return {**asdict(self), "shared_bytes": self.shared_bytes, "ratio": self.ratio}


def hybrid_row(shape: KVShape, num_agents: int, prefix_tokens: int, tail_tokens: int) -> HybridRow:
    """The per-slot and shared footprints of `num_agents` agents of `prefix_tokens` + `tail_tokens` each."""
    assert shape.recurrent is not None, "only a hybrid model keeps state snapshots"
    if num_agents <= 0 or tail_tokens <= 0 or prefix_tokens < 0:
        raise ValueError(
            f"--agents and --tail-tokens must be positive and prefixes >= 0, got {num_agents}, {tail_tokens},"
            f" {prefix_tokens}"
        )
    per_token, state = shape.kv_bytes_per_token, shape.state_bytes_per_sequence
    num_snapshots = int(num_agents > 1 and shape.shares_prefix(prefix_tokens))
    prefix_copies = 1 if num_snapshots else num_agents
    return HybridRow(
        prefix_tokens=prefix_tokens,
        tail_tokens=tail_tokens,
        num_agents=num_agents,
        kv_bytes_per_slot_total=num_agents * (prefix_tokens + tail_tokens) * per_token,
        kv_bytes_tails=num_agents * tail_tokens * per_token,
        kv_bytes_shared_total=(prefix_copies * prefix_tokens + num_agents * tail_tokens) * per_token,
        num_snapshots=num_snapshots,
        snapshot_bytes=num_snapshots * state,
        running_state_bytes=num_agents * state,
    )


def hybrid_rows(
    shape: KVShape, num_agents: int, prefix_tokens: Sequence[int], tail_tokens: int
) -> list[HybridRow] | None:
    """One row per prefix length for a hybrid shape; None for a pure transformer."""
    if shape.recurrent is None:
        return None
    return [hybrid_row(shape, num_agents, p, tail_tokens) for p in prefix_tokens]
