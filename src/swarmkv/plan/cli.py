"""`swarmkv plan`: what N agents' copies of a shared prefix cost in KV, what storing it once reclaims, and
how many agents fit on a card beside the weights and the runtime reserve."""

from __future__ import annotations

import argparse
import json
import sys

from swarmkv.choices import KV_CACHE_DTYPES
from swarmkv.cluster.routing import DEFAULT_IMBALANCE, DEFAULT_MIN_MATCH, POLICIES
from swarmkv.cluster.trace import TRACE_SHAPES
from swarmkv.config import DTYPES
from swarmkv.core.config import EngineConfig
from swarmkv.kv import RETENTION_POLICIES
from swarmkv.plan.checkpoint import Checkpoint
from swarmkv.plan.flags import parse_counts, resolve_checkpoint
from swarmkv.plan.hybrid import hybrid_rows
from swarmkv.plan.measure import measure_rows
from swarmkv.plan.report import report, to_json
from swarmkv.plan.report_cluster import DEFAULT_REPLICA_KV, run_cluster
from swarmkv.plan.reserve import DEFAULT_WORKSPACE, RuntimeReserve, runtime_reserve
from swarmkv.plan.result import Plan
from swarmkv.plan.shape import element_bytes
from swarmkv.plan.table import VramBudget, fit_agents, prefix_rows
from swarmkv.plan.weights import WEIGHT_FORMATS, WeightsFigure, check_weights, count_weights
from swarmkv.units import parse_size

DEFAULT_PREFIXES = "1000,2000,3000,4000"
GGUF_UNCHECKED = (
    "a GGUF's weights are counted tensor by tensor through the loader's own rule (models/gguf_held.py), not"
    " from a model built on the meta device"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand."""
    parser = subparsers.add_parser(
        "plan", help="KV cost of a shared prefix across N agents, what sharing saves, and what fits a card"
    )
    shape = parser.add_argument_group("model shape (give --model, or --layers, --kv-heads and --head-dim)")
    shape.add_argument("--model", default=None, help="HF directory, config.json or GGUF file")
    shape.add_argument("--layers", type=int, default=None, help="attention layers that keep KV")
    shape.add_argument("--kv-heads", type=int, default=None, help="KV heads per layer")
    shape.add_argument("--head-dim", type=int, default=None, help="dimension of each head")
    shape.add_argument("--hidden-size", type=int, default=None, help="model width (to count weights)")
    shape.add_argument("--intermediate-size", type=int, default=None, help="MLP width (to count weights)")
    shape.add_argument("--vocab-size", type=int, default=None, help="vocabulary size (to count weights)")
    shape.add_argument("--heads", type=int, default=None, help="attention (query) heads (to count weights)")
    shape.add_argument("--tie-embeddings", action="store_true", help="the LM head is the embedding matrix")
    shape.add_argument("--qk-norm", action="store_true", help="per-head q and k RMSNorms (Qwen3)")
    shape.add_argument("--attention-bias", action="store_true", help="QKV projections have biases (Qwen2)")
    shape.add_argument(
        "--weight-format",
        default="auto",
        choices=WEIGHT_FORMATS,
        help="projection weights: auto (a GGUF's own: every tensor at its file's bits, counted tensor by tensor;"
        " an HF checkpoint's dtype), int4 (groups of 32), int8 (groups of 32), or one float dtype",
    )
    shape.add_argument(
        "--kv-dtype",
        "--kv-cache-dtype",
        "--dtype",
        dest="kv_dtype",
        default=EngineConfig.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="KV page dtype, the engine's --kv-cache-dtype: auto (the weights' float dtype), or a dtype;"
        " fp8_e4m3 is one byte per element",
    )
    shape.add_argument(
        "--mtp",
        action="store_true",
        help="a GGUF's multi-token-prediction layer held too, with its KV slab, as `serve --speculative-method"
        " mtp|both` holds it (default: left out, as the engine leaves it)",
    )
    shape.add_argument(
        "--state-dtype",
        default=None,
        choices=tuple(DTYPES),
        help="hybrid models' recurrent state, conv window and matrices alike, in this dtype (default as the"
        " engine keeps it: the window at the weights' float dtype, the matrices at least float32)",
    )
    parser.add_argument("--agents", type=int, default=8, help="agents sharing the prefix (default 8)")
    parser.add_argument("--prefix-tokens", default=DEFAULT_PREFIXES, help="comma-separated prefix lengths")
    fit = parser.add_argument_group("fit on a card")
    fit.add_argument("--vram", default=None, help="card memory, e.g. 16GiB: also report how many agents fit")
    fit.add_argument("--weights", default=None, help="weights size (default: counted from the shape)")
    fit.add_argument("--context", type=int, default=8192, help="tokens per agent (default 8192)")
    fit.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        help=f"tokens per KV page (default {EngineConfig.block_size}, the engine's)",
    )
    fit.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=EngineConfig.max_num_batched_tokens,
        help=f"largest prefill chunk, for the activations (default {EngineConfig.max_num_batched_tokens})",
    )
    fit.add_argument(
        "--max-num-seqs",
        type=int,
        default=EngineConfig.max_num_seqs,
        help=f"rows sampled per step, for the logits (default {EngineConfig.max_num_seqs})",
    )
    fit.add_argument(
        "--workspace",
        default=DEFAULT_WORKSPACE,
        help=f"CUDA context and workspace allowance (default {DEFAULT_WORKSPACE})",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="also count pages through the real allocator, and weights in a model built on the meta device",
    )
    parser.add_argument(
        "--tail-tokens",
        type=int,
        default=100,
        help="each agent's private tail after the prefix, for a hybrid's totals and --measure (default 100)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object, all figures in bytes")
    _register_cluster(parser)
    parser.set_defaults(run=run)


def _register_cluster(parser: argparse.ArgumentParser) -> None:
    """The cluster simulator's flags: with --replicas, plan replays a multi-swarm trace instead."""
    sim = parser.add_argument_group(
        "cluster simulator (--replicas; the shape defaults to 40 layers x 8 KV heads x 128, fp16; reuses --agents)"
    )
    sim.add_argument("--replicas", default=None, help="comma-separated replica counts, e.g. 1,2,4,8,16,32,64")
    sim.add_argument("--swarms", type=int, default=256, help="swarms in the trace (default 256)")
    sim.add_argument("--turns", type=int, default=4, help="turns per agent (default 4)")
    sim.add_argument(
        "--sim-trace",
        choices=TRACE_SHAPES,
        default="synthetic",
        help="first requests: each swarm its own head (synthetic), or the coding harnesses' shapes, one head"
        " per harness shared by its swarms, per-instance text where each harness puts it (default synthetic)",
    )
    sim.add_argument(
        "--head-tokens", type=int, default=2000, help="mean tokens of a swarm's head (default 2000)"
    )
    sim.add_argument(
        "--replica-kv",
        default=DEFAULT_REPLICA_KV,
        help=f"each replica's KV budget: a size, or N pages as 'Npages' (default {DEFAULT_REPLICA_KV})",
    )
    sim.add_argument(
        "--sim-page-size",
        type=int,
        default=64,
        help="tokens per page in the simulated replicas and router (default 64, TensorRT-LLM's; 16 is the"
        " engine's and takes several times as long)",
    )
    sim.add_argument("--router-policies", default=",".join(POLICIES), help="policies to compare")
    sim.add_argument(
        "--route-min-match", type=int, default=DEFAULT_MIN_MATCH, help="prefix policy's least match"
    )
    sim.add_argument(
        "--route-imbalance", type=int, default=DEFAULT_IMBALANCE, help="prefix policy's in-flight load slack"
    )
    sim.add_argument(
        "--sim-retention",
        choices=RETENTION_POLICIES,
        default=EngineConfig.retention,
        help=f"the simulated replicas' eviction policy, which the router's shadows follow (default"
        f" {EngineConfig.retention}, a replica's own)",
    )
    sim.add_argument(
        "--sim-busy",
        type=float,
        default=0.8,
        help="each row runs again with prefill slowed until the reference's prefill keeps the replicas this busy;"
        " that run's p95 queueing delay is reported (default 0.8)",
    )
    sim.add_argument(
        "--sim-workers", type=int, default=2, help="processes that run the sweep's rows (default 2)"
    )
    sim.add_argument("--seed", type=int, default=0, help="seed of the trace and the router (default 0)")
    sim.add_argument("--plot", default=None, help="also save hit rate against replicas to this PNG")


def parse_prefixes(text: str) -> list[int]:
    """ "1000,2000" -> [1000, 2000]; ValueError on anything that is not a list of token counts >= 0."""
    return parse_counts(text, "--prefix-tokens", 0, "token counts")


def weights_figure(args: argparse.Namespace, checkpoint: Checkpoint) -> WeightsFigure:
    """The weights' bytes for the budget: --weights, else a GGUF's tensors as held, else counted from the
    config, else the files' size."""
    precision, files = checkpoint.precision, checkpoint.file_bytes
    if args.weights is not None:
        return WeightsFigure(parse_size(args.weights), "--weights", precision, None, files)
    if checkpoint.gguf_weights is not None:
        gguf = checkpoint.gguf_weights
        return WeightsFigure(gguf.total_bytes, "gguf", precision, None, files, gguf)
    if checkpoint.config is not None:
        count = count_weights(checkpoint.config, precision)
        return WeightsFigure(count.total_bytes, "config", precision, count, files)
    if args.weight_format == "auto" and files is not None:
        return WeightsFigure(files, "files", precision, None, files)
    raise ValueError(
        f"--vram needs the weights' size, and they cannot be counted here ({checkpoint.config_problem}):"
        " pass --weights SIZE"
    )


def reserve_for(args: argparse.Namespace, checkpoint: Checkpoint) -> RuntimeReserve | None:
    """The runtime reserve of the checkpoint's model, None when its dimensions are not known."""
    dims = checkpoint.config if checkpoint.config is not None else checkpoint.dims
    if dims is None:
        return None
    return runtime_reserve(
        dims,
        element_bytes(checkpoint.precision.dtype),
        args.max_num_batched_tokens,
        args.max_num_seqs,
        parse_size(args.workspace),
    )


def run(args: argparse.Namespace) -> int:
    """Compute the table (and the fit, and the measurements), print it; with --replicas, the cluster simulator."""
    if args.replicas is not None:
        return run_cluster(args)
    prefixes = parse_prefixes(args.prefix_tokens)
    checkpoint = resolve_checkpoint(args)
    shape = checkpoint.shape
    rows = prefix_rows(shape, args.agents, prefixes)
    hybrid = hybrid_rows(shape, args.agents, prefixes, args.tail_tokens)
    budget, fits, weights, reserve = None, None, None, None
    if args.vram is not None:
        weights = weights_figure(args, checkpoint)
        reserve = reserve_for(args, checkpoint)
        reserve_bytes = reserve.total_bytes if reserve is not None else 0
        budget = VramBudget(
            parse_size(args.vram), weights.num_bytes, args.context, args.block_size, reserve_bytes
        )
        fits = [fit_agents(shape, budget, p) for p in prefixes]
    measured, check, unchecked = None, None, checkpoint.config_problem
    if args.measure:
        measured = measure_rows(shape, args.agents, prefixes, args.block_size, args.tail_tokens)
        if checkpoint.gguf_weights is not None:
            unchecked = GGUF_UNCHECKED
        elif checkpoint.config is not None:
            check = check_weights(checkpoint.config, checkpoint.precision)
    plan = Plan(
        shape,
        args.agents,
        rows,
        budget,
        fits,
        weights,
        reserve,
        measured,
        check,
        checkpoint.config_problem,
        hybrid,
        checkpoint.gguf_weights,
        unchecked,
    )
    print(json.dumps(to_json(plan)) if args.json else report(plan))
    for problem in plan.problems:
        print(f"swarmkv plan: measured and formula disagree: {problem}", file=sys.stderr)
    return 1 if plan.problems else 0
