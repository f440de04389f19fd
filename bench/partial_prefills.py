"""Time to first token of a burst of equal requests, against how many requests one step may prefill
(`max_num_partial_prefills`). Eight agents returning from their tool calls together each bring a tail to
prefill; the scheduler finishes the shortest first. With every prefill in one step, all of them get their first
token when the last is done; one or a few at a time, most get theirs sooner. The wall should not change where a
step's cost grows with its tokens (a CPU).

    .venv/bin/python bench/partial_prefills.py [--requests 8] [--tokens 256] [--gen 16] [--limits 0 1 2 4]

0 is no limit (the token budget alone). Each limit runs twice, interleaved, and the better wall is kept.
"""

from __future__ import annotations

import argparse
import statistics
import time

from swarmkv import SamplingParams
from swarmkv.core.config import EngineConfig
from swarmkv.engine.engine import LLMEngine
from swarmkv.models.loader import load_model


def burst(engine: LLMEngine, prompts: list[list[int]], gen: int, tag: str) -> tuple[list[float], float]:
    """Queue every prompt at once and step to the end: each request's time to first token, and the wall."""
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    start = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", ids, params)
    first: dict[str, float] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            if delta.new_token_ids and delta.request_id not in first:
                first[delta.request_id] = time.perf_counter() - start
    return sorted(first.values()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument(
        "--tokens", type=int, default=256, help="prompt tokens per request (distinct prompts)"
    )
    parser.add_argument("--gen", type=int, default=16)
    parser.add_argument("--limits", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--weights", default="auto")
    args = parser.parse_args()
    loaded = load_model(None, weights=args.weights)
    vocab = loaded.config.vocab_size
    runs: dict[int, list[tuple[list[float], float]]] = {limit: [] for limit in args.limits}
    engines = {
        limit: LLMEngine(
            loaded,
            EngineConfig(kv_cache_memory="256MiB", max_num_partial_prefills=limit, prefix_caching=False),
        )
        for limit in args.limits
    }
    for repeat in range(2):
        for limit in args.limits:
            # Distinct prompts per run, so no run reads another's cached pages.
            prompts = [
                [
                    (1000 + 7919 * (repeat * 97 + limit * 31 + i) + 13 * t) % (vocab - 100) + 50
                    for t in range(args.tokens)
                ]
                for i in range(args.requests)
            ]
            runs[limit].append(burst(engines[limit], prompts, args.gen, f"r{repeat}l{limit}"))
    print(
        f"{args.requests} requests x {args.tokens} prompt tokens, {args.gen} generated each; "
        f"{loaded.name}, {loaded.weights}, CPU"
        if loaded.device.type == "cpu"
        else loaded.device.type
    )
    base = None
    print(
        f"{'prefills a step':>16} {'TTFT mean s':>12} {'TTFT median s':>14} {'last TTFT s':>12} {'wall s':>8}  vs no limit"
    )
    for limit in args.limits:
        ttfts, wall = min(runs[limit], key=lambda run: run[1])
        mean, median = statistics.mean(ttfts), statistics.median(ttfts)
        if base is None:
            base = (mean, median, wall)
        label = "no limit" if limit == 0 else str(limit)
        print(
            f"{label:>16} {mean:>12.2f} {median:>14.2f} {ttfts[-1]:>12.2f} {wall:>8.2f}  "
            f"mean {base[0] / mean:.2f}x, median {base[1] / median:.2f}x, wall {base[2] / wall:.2f}x"
        )


if __name__ == "__main__":
    main()
