"""8 agents sharing a 2,000-token head: swarmkv shared (with and without cascade decode) vs swarmkv per-slot vs
transformers generate.

Run: .venv/bin/python bench/engine.py [--agents 8 --prefix 2000 --tail 200 --gen 64]
Every figure comes from this one run; ratios compare layouts measured minutes apart on the same machine.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from swarmkv import LLM, SamplingParams
from swarmkv.models.default import default_model_path


@dataclass
class Result:
    name: str
    wall_s: float
    prefill_tokens: int
    peak_kv_bytes: int
    decode_tokens_per_s: float
    outputs: list[list[int]]


def make_prompts(tokenizer, agents: int, prefix: int, tail: int, seed: int) -> list[list[int]]:
    """One shared head of `prefix` tokens and a private `tail` per agent, from real text."""
    rng = random.Random(seed)
    words = [
        "agent",
        "tool",
        "schema",
        "read",
        "write",
        "file",
        "run",
        "command",
        "search",
        "code",
        "diff",
        "test",
        "repository",
    ]
    text = " ".join(rng.choice(words) for _ in range(prefix * 2))
    head = tokenizer.encode(text)[:prefix]
    tails = []
    for i in range(agents):
        private = " ".join(rng.choice(words) for _ in range(tail * 2))
        tails.append(tokenizer.encode(f" agent {i}: {private}")[:tail])
    return [head + t for t in tails]


def run_swarmkv(name: str, llm_kwargs: dict, loaded, prompts, gen: int, per_slot: bool) -> Result:
    """One swarmkv layout; per-slot salts each agent, so it shares nothing with the others."""
    llm = LLM(loaded=loaded, **llm_kwargs)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"a{i}", p, params, cache_salt=f"agent-{i}" if per_slot else None)
    outputs: dict[str, list[int]] = {f"a{i}": [] for i in range(len(prompts))}
    decode_s, decode_tokens = 0.0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        before = engine.counters.prefill_tokens_computed
        t0 = time.perf_counter()
        deltas = engine.step()
        if engine.counters.prefill_tokens_computed == before:
            decode_s += time.perf_counter() - t0
            decode_tokens += sum(len(d.new_token_ids) for d in deltas)
        for d in deltas:
            outputs[d.request_id] += d.new_token_ids
    wall = time.perf_counter() - start
    stats = engine.stats()
    return Result(
        name,
        wall,
        stats["prefill_tokens_computed"],
        stats["peak_kv_bytes_used"],
        decode_tokens / decode_s if decode_s else 0.0,
        [outputs[f"a{i}"] for i in range(len(prompts))],
    )


def run_transformers(prompts, gen: int) -> Result:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generation requires
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    stamps: list[float] = []

    def stamp(input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        stamps.append(time.perf_counter())  # called once per generated token, right after its forward
        return scores

    from transformers import LogitsProcessorList

    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=gen,
            min_new_tokens=gen,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([stamp]),
        )
        wall = time.perf_counter() - start
    cfg = model.config
    kv_per_token = (
        2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    )
    peak = len(prompts) * (width + gen) * kv_per_token  # a dense cache holds every row at full width
    decode_s = stamps[-1] - stamps[0]  # from the first token (end of prefill) to the last
    return Result(
        "transformers generate (batched)",
        wall,
        len(prompts) * width,
        peak,
        len(prompts) * (gen - 1) / decode_s,
        [row[width:].tolist() for row in out],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agents", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=2000)
    parser.add_argument("--tail", type=int, default=200)
    parser.add_argument("--gen", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-transformers", action="store_true")
    # float by default: transformers runs the same dequantised weights, and earlier figures were taken so
    parser.add_argument("--weights", choices=("float", "int8", "int4"), default="float")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    # loads the default model once; each run builds its own engine
    llm = LLM(weights=args.weights, kv_cache_memory="64MiB")
    loaded = llm.loaded
    prompts = make_prompts(loaded.tokenizer, args.agents, args.prefix, args.tail, args.seed)
    kv_bytes = (
        2
        * args.agents
        * (args.prefix + args.tail + args.gen + 64)
        * loaded.config.kv_bytes_per_token(loaded.dtype)
    )
    kwargs = {"kv_cache_memory": kv_bytes, "max_num_batched_tokens": 2048}
    # Warm up on a short request, so that first-run costs land on no layout.
    LLM(loaded=loaded, kv_cache_memory=kv_bytes).generate([prompts[0][:64]], SamplingParams(max_tokens=2))
    results = [
        run_swarmkv("swarmkv shared", kwargs, loaded, prompts, args.gen, per_slot=False),
        run_swarmkv(
            "swarmkv shared, no cascade",
            {**kwargs, "cascade_attention": "off"},
            loaded,
            prompts,
            args.gen,
            per_slot=False,
        ),
        run_swarmkv("swarmkv per-slot", kwargs, loaded, prompts, args.gen, per_slot=True),
    ]
    if not args.skip_transformers:
        results.append(run_transformers(prompts, args.gen))
    shared = results[0]
    print(
        f"\n{args.agents} agents x ({args.prefix} shared + {args.tail} private) tokens, {args.gen} generated each"
    )
    print(
        f"{'run':34} {'wall s':>8} {'prefill tok':>12} {'peak KV MiB':>12} {'decode tok/s':>13} {'shared speedup':>15}"
    )
    for r in results:
        print(
            f"{r.name:34} {r.wall_s:8.2f} {r.prefill_tokens:12,} {r.peak_kv_bytes / 2**20:12.1f} "
            f"{r.decode_tokens_per_s:13.1f} {r.wall_s / shared.wall_s:14.2f}x"
        )
    for r in results[1:]:
        print(
            f"shared vs {r.name}: {r.wall_s / shared.wall_s:.2f}x faster end to end, "
            f"peak KV {shared.peak_kv_bytes / r.peak_kv_bytes:.3f}x, "
            f"prefill tokens {shared.prefill_tokens / r.prefill_tokens:.3f}x"
        )
        same = sum(a == b for a, b in zip(shared.outputs, r.outputs, strict=True))
        print(f"  greedy outputs identical for {same}/{len(prompts)} agents")
    no_cascade = results[1]
    print(
        f"cascade decode: {shared.decode_tokens_per_s / no_cascade.decode_tokens_per_s:.2f}x the decode tok/s of"
        f" the same shared layout without it; sharing alone: {no_cascade.decode_tokens_per_s:.1f} against"
        f" {results[2].decode_tokens_per_s:.1f} tok/s per-slot"
    )
    print("targets: >= 3x faster than both baselines; peak KV <= 0.3x the per-slot run")


if __name__ == "__main__":
    main()
