"""The report's card lines: the weights and the runtime reserve part by part, the agents that fit, and the
weights check against the model built on the meta device."""

from __future__ import annotations

from swarmkv.kv.state_index import MIN_SNAPSHOT_TOKENS
from swarmkv.plan.layout import Item, breakdown, size, table
from swarmkv.plan.report_gguf import gguf_weights_items
from swarmkv.plan.reserve import ACTIVATION_FACTOR, LOGITS_BYTES_PER_ELEMENT
from swarmkv.plan.result import Plan
from swarmkv.plan.table import AgentFit, VramBudget
from swarmkv.plan.weights import AGREEMENT_FRACTION, WeightsFigure
from swarmkv.units import format_gib


def weights_items(plan: Plan, weights: WeightsFigure) -> list[Item]:
    """The weights' figure, part by part when counted from the config."""
    files = f"; the files hold {size(weights.file_bytes)}" if weights.file_bytes is not None else ""
    if weights.source == "--weights":
        return [("weights", weights.num_bytes, f"as given by --weights{files}")]
    if weights.gguf is not None:
        return gguf_weights_items(weights.gguf)
    if weights.count is None:
        return [("weights", weights.num_bytes, f"the weight files' size ({plan.config_problem})")]
    count, dtype = weights.count, weights.count.dtype
    linear = "; linear attention's in and out" if count.recurrent_bytes else ""
    layout = {
        "int4": f"int4 in groups of 32, a {dtype} scale and minimum per group",
        "int8": "int8 in groups of 32, a float16 scale and minimum per group",
    }.get(count.weight_format, dtype)
    items = [
        (
            "weights",
            count.total_bytes,
            f"at {count.weight_format}, all but the projections in {dtype}{files}:",
        ),
        ("  projections", count.projections_bytes, f"{layout} (qkv, o, gate-up, down{linear})"),
        ("  norms", count.norms_bytes, ""),
    ]
    if count.recurrent_bytes:
        items.append(
            (
                "  linear attention",
                count.recurrent_bytes,
                f"b | a projections in {dtype}, conv taps, decay parameters, gated norms",
            )
        )
    if count.biases_bytes:
        items.append(("  QKV biases", count.biases_bytes, ""))
    if count.tied_embeddings:
        return [*items, ("  embedding", count.embedding_bytes, "also the LM head (tied)")]
    return [*items, ("  embedding", count.embedding_bytes, ""), ("  LM head", count.lm_head_bytes, "")]


def reserve_items(plan: Plan) -> list[Item]:
    """The runtime reserve, part by part with each constant."""
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


def fit_lines(plan: Plan, budget: VramBudget, fits: list[AgentFit], weights: WeightsFigure) -> list[str]:
    """The budget part by part, then the agents that fit per-slot and shared."""
    shape = plan.shape
    per_slot = fits[0]
    kv = "KV pages and recurrent state" if shape.recurrent else "KV pages"
    items = [
        *weights_items(plan, weights),
        *reserve_items(plan),
        ("KV budget", budget.kv_budget_bytes, f"what is left for {kv}"),
    ]
    lines = [
        "",
        f"Fit in {format_gib(budget.vram_bytes)} of VRAM, KV at {shape.dtype}"
        f" ({shape.kv_bytes_per_token / 1024:.2f} KiB per token), {budget.context_tokens:,}-token context per"
        f" agent in {budget.block_size}-token pages:",
        *breakdown(items),
        f"Agents that fit: {per_slot.agents_fit_per_slot} per-slot (each stores its whole context,"
        f" {size(per_slot.agent_bytes_per_slot)}); shared, each prefix's full pages are stored once"
        + (
            f", with one state snapshot at its end ({size(shape.state_bytes_per_sequence)}; a hybrid shares"
            f" no prefix under {MIN_SNAPSHOT_TOKENS} tokens):"
            if shape.recurrent
            else ":"
        ),
    ]
    cells = [[f"{f.prefix_tokens:,}", str(f.agents_fit_per_slot), str(f.agents_fit_shared)] for f in fits]
    return lines + table(["Prefix tokens", "Agents per-slot", "Agents shared"], cells)


def weights_check_lines(plan: Plan) -> list[str]:
    """The formula's weights against the model built on the meta device, or why they were not checked."""
    check = plan.weights_check
    if check is None:
        return [f"Weights not checked: {plan.weights_unchecked or plan.config_problem}"]
    share = abs(check.difference_bytes) / check.formula_bytes if check.formula_bytes else 0.0
    verdict = "agrees" if check.agrees else "DISAGREES"
    return [
        f"Weights: the model built at {check.weight_format} on the meta device holds {check.measured_bytes:,} B"
        f" in parameters and buffers; the formula counts {check.formula_bytes:,} B: difference"
        f" {check.difference_bytes:+,} B ({share:.3%}), within {AGREEMENT_FRACTION:.0%}: {verdict}."
    ]
