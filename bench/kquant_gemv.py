"""The CPU GEMV over K-quant weights (Q4_K, Q5_K, Q6_K) at the shapes a Qwen3.5 Q4_K_M file holds, float32
activations (`cpu_grouped.matmul`) against int8 ones (`cpu_grouped.matmul_int8`, the decode step's default):
milliseconds and GB/s of the weight's bytes, one thread by default, the best of --repeats. Random weights in
swarmkv's own quantizer's blocks; the kernels read them as they read a file's.

    .venv/bin/python bench/kquant_gemv.py [--rows 1] [--threads 1] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
from gguf import GGMLQuantizationType as Q

from swarmkv.kernels import cpu_grouped
from swarmkv.models.gguf_quantize import quantize
from swarmkv.models.gguf_quants import parse_blocks

# (type, out_features, in_features): the 0.8B file's linear-attention in_proj and MLP, and its tied LM head
SHAPES = [
    (Q.Q4_K, 6144, 1024),
    (Q.Q4_K, 7168, 1024),
    (Q.Q5_K, 6144, 1024),
    (Q.Q6_K, 6144, 1024),
    (Q.Q6_K, 1024, 3584),
    (Q.Q6_K, 151936, 1024),
]


def best_seconds(run: Callable[[], object], nbytes: int, repeats: int) -> float:
    """The least seconds a call took over `repeats` timings of enough calls to read ~50 MB each."""
    run()
    calls = max(3, int(5e7 / nbytes))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            run()
        best = min(best, (time.perf_counter() - start) / calls)
    return best


def main(argv: list[str] | None = None) -> int:
    """Time every shape with both activations and print a row each."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=1, help="rows of x (1: one request's decode)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every out_features (tests: 0.01)")
    args = parser.parse_args(argv)
    if not cpu_grouped.available():
        raise SystemExit("no C compiler: the CPU kernels are not built")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{'type':<6} {'shape':>14} {'float32 x':>20} {'int8 x':>20}")
    for kind, rows, cols in SHAPES:
        rows = max(16, int(rows * args.scale))
        raw = quantize(torch.randn(rows, cols) * 0.05, kind)
        weight = parse_blocks(raw, kind, (rows, cols))
        x = torch.randn(args.rows, cols)
        cells = []
        for kernel in (cpu_grouped.matmul, cpu_grouped.matmul_int8):
            seconds = best_seconds(partial(kernel, x, weight), raw.nbytes, args.repeats)
            cells.append(f"{seconds * 1e3:8.3f} ms {raw.nbytes / seconds / 1e9:5.1f} GB/s")
        print(f"{kind.name:<6} {f'{rows}x{cols}':>14} {cells[0]:>20} {cells[1]:>20}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
