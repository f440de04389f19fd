"""`swarmkv plan`: the KV arithmetic of a shared prefix across an agent swarm, and a check against the allocator."""

from swarmkv.plan.measure import MeasuredRow, measure_row, measure_rows
from swarmkv.plan.shape import Checkpoint, KVShape, RecurrentState, load_checkpoint, shape_from_hf_dict
from swarmkv.plan.table import AgentFit, PrefixRow, VramBudget, fit_agents, prefix_row, prefix_rows

__all__ = [
    "AgentFit",
    "Checkpoint",
    "KVShape",
    "MeasuredRow",
    "PrefixRow",
    "RecurrentState",
    "VramBudget",
    "fit_agents",
    "load_checkpoint",
    "measure_row",
    "measure_rows",
    "prefix_row",
    "prefix_rows",
    "shape_from_hf_dict",
]
