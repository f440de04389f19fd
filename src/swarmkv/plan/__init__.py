"""`swarmkv plan`: the KV arithmetic of a shared prefix across an agent swarm, the weights and runtime reserve
beside it on a card, and checks against the allocator and the model code."""

from swarmkv.plan.checkpoint import Checkpoint, load_checkpoint
from swarmkv.plan.hybrid import HybridRow, hybrid_row, hybrid_rows
from swarmkv.plan.measure import MeasuredRow, measure_row, measure_rows
from swarmkv.plan.reserve import RuntimeReserve, runtime_reserve
from swarmkv.plan.shape import KVShape, RecurrentState, shape_from_hf_dict, state_dtypes
from swarmkv.plan.table import AgentFit, PrefixRow, VramBudget, fit_agents, prefix_row, prefix_rows
from swarmkv.plan.weights import Precision, WeightCount, WeightsCheck, check_weights, count_weights

__all__ = [
    "AgentFit",
    "Checkpoint",
    "HybridRow",
    "KVShape",
    "MeasuredRow",
    "Precision",
    "PrefixRow",
    "RecurrentState",
    "RuntimeReserve",
    "VramBudget",
    "WeightCount",
    "WeightsCheck",
    "check_weights",
    "count_weights",
    "fit_agents",
    "hybrid_row",
    "hybrid_rows",
    "load_checkpoint",
    "measure_row",
    "measure_rows",
    "prefix_row",
    "prefix_rows",
    "runtime_reserve",
    "shape_from_hf_dict",
    "state_dtypes",
]
