"""What one `swarmkv plan` run computed, and where its measurements disagree with its formulas."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from swarmkv.plan.hybrid import HybridRow
from swarmkv.plan.measure import MeasuredRow
from swarmkv.plan.reserve import RuntimeReserve
from swarmkv.plan.shape import KVShape
from swarmkv.plan.table import AgentFit, PrefixRow, VramBudget
from swarmkv.plan.weights import WeightsCheck, WeightsFigure

if TYPE_CHECKING:  # the gguf package loads only for GGUF files
    from swarmkv.plan.gguf_count import GGUFWeightCount


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
    hybrid: list[HybridRow] | None = None  # hybrids: prefix + tails per-slot against shared with snapshots
    gguf_weights: GGUFWeightCount | None = None  # a GGUF's tensors as held, per type
    weights_unchecked: str | None = None  # why --measure did not check the weights, when it did not

    def measured_disagreements(self) -> list[str]:
        """Measured pages and state slots that fall outside the tolerance of the formula's."""
        if not self.measured:
            return []
        hybrid: list[HybridRow | None] = [*self.hybrid] if self.hybrid else [None] * len(self.rows)
        triples = zip(self.measured, self.rows, hybrid, strict=True)
        return [f"{m.prefix_tokens} tokens: {d}" for m, row, h in triples for d in m.disagreements(row, h)]

    @property
    def problems(self) -> list[str]:
        """Measured figures that fall outside the tolerance of the formula's."""
        found = self.measured_disagreements()
        check = self.weights_check
        if check is not None and not check.agrees:
            found.append(
                f"weights at {check.weight_format}: measured {check.measured_bytes:,} B,"
                f" formula {check.formula_bytes:,} B"
            )
        return found
