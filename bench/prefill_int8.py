"""Prefill on int8 activations (`EngineConfig.cpu_prefill_int8`): the int8 GEMM over K-quant blocks against
today's float path (each block dequantised exactly, then torch's float32 matmul), for a kernel and for a whole
prefill, beside llama.cpp's pp512 on the same file.

- `--kernels`: the GEMM of `--rows` rows of x (512, a prefill chunk) at the shapes of a Qwen3.5 Q4_K_M file's
  projections, random weights in swarmkv's own quantizer's blocks: GFLOP/s of `cpu_grouped.gemm_int8`, of the
  dequantise-then-matmul path, and of torch's float32 mm on the already dequantised weight, each ratio against
  that mm measured in the same run (best of --repeats, interleaved; with one thread, the thread's CPU time).
- `--model FILE`: a 512-token prefill with no prefix hit (as bench/versus_llama.py times it: `generate` with
  max_tokens=1), float path and int8 path toggled on the same engine (`gguf_linear.use_prefill_int8`) and
  `llama-bench -p 512 -n 0 -r 1`, interleaved a repeat at a time; median and spread of each.

    .venv/bin/python bench/prefill_int8.py --kernels [--threads 2]
    .venv/bin/python bench/prefill_int8.py --model FILE [--llama-bench PATH] [--repeats 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from gguf import GGMLQuantizationType as Q  # noqa: E402

from decode import distinct_prompts, generate_seconds, run_llama_bench  # noqa: E402
from swarmkv import LLM  # noqa: E402
from swarmkv.kernels import cpu_grouped  # noqa: E402
from swarmkv.models import gguf_linear  # noqa: E402
from swarmkv.models.gguf_quantize import quantize  # noqa: E402
from swarmkv.models.gguf_quants import GroupedQuant, parse_blocks  # noqa: E402

# (type, out_features, in_features): the 0.8B Qwen3.5 Q4_K_M file's in_proj (Q6_K), MLP gate/up (Q4_K) and down
# (Q4_K and Q6_K), attention output (Q4_K)
SHAPES = [
    (Q.Q6_K, 6144, 1024),
    (Q.Q4_K, 3584, 1024),
    (Q.Q4_K, 1024, 3584),
    (Q.Q6_K, 1024, 3584),
    (Q.Q4_K, 1024, 2048),
]


def best_seconds(runs: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each callable's least seconds over `repeats` rounds, the callables interleaved within a round."""
    # One thread runs on the caller's (torch's and the kernel's alike): its CPU time leaves out the time other
    # work on a shared machine took from it.
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    best = dict.fromkeys(runs, float("inf"))
    for run in runs.values():
        run()
    for _ in range(repeats):
        for name, run in runs.items():
            start = clock()
            run()
            best[name] = min(best[name], clock() - start)
    return best


def _paths(
    x: torch.Tensor, weight: GroupedQuant, dense: torch.Tensor, out: torch.Tensor
) -> dict[str, Callable[[], object]]:
    """torch's mm on the dequantised weight, today's prefill path (dequantise, then mm) and the int8 GEMM."""
    return {
        "mm": lambda: torch.mm(x, dense.t(), out=out),
        "today": lambda: torch.mm(x, cpu_grouped.dequantize_rows(weight).t(), out=out),
        "int8": lambda: cpu_grouped.gemm_int8(x, weight, out),
    }


def kernels(rows: int, repeats: int) -> None:
    """Print each shape's GFLOP/s on the three paths and their ratios to torch's float32 mm."""
    torch.manual_seed(0)
    print(f"{'type':<5} {'shape':>10} {'mm float32':>11} {'today':>15} {'int8 GEMM':>15}   (GFLOP/s, x mm)")
    for kind, n, k in SHAPES:
        weight = parse_blocks(quantize(torch.randn(n, k) * 0.05, kind), kind, (n, k))
        x, out = torch.randn(rows, k), torch.empty(rows, n)
        best = best_seconds(_paths(x, weight, weight.dequantize(), out), repeats)
        rate = {name: 2 * rows * n * k / s / 1e9 for name, s in best.items()}
        cells = [f"{rate[p]:6.1f} {best['mm'] / best[p]:5.2f}x" for p in ("today", "int8")]
        print(f"{kind.name:<5} {f'{n}x{k}':>10} {rate['mm']:11.1f} {cells[0]:>15} {cells[1]:>15}")


def spread(samples: list[float]) -> str:
    """Median (least-most) of a figure's samples."""
    return f"{statistics.median(samples):7.1f} ({min(samples):.1f}-{max(samples):.1f})"


def prefill(path: Path, llama_bench: Path | None, threads: int, tokens: int, repeats: int) -> None:
    """Time the prefill on both paths and llama-bench's pp, interleaved; print median and spread."""
    llm = LLM(str(path), dtype="float32", prefix_caching=False, speculation="off", state_memory="512MiB")
    model = llm.engine.runner.model
    prompt = distinct_prompts(1, tokens, llm.loaded.config.vocab_size, seed=1000)
    samples: dict[str, list[float]] = {"float32": [], "int8": [], "llama.cpp": []}
    for on in (False, True):  # warm-up
        gguf_linear.use_prefill_int8(model, on)
        generate_seconds(llm, prompt, 1)
    for _ in range(repeats):
        for name, on in (("float32", False), ("int8", True)):
            gguf_linear.use_prefill_int8(model, on)
            samples[name].append(tokens / generate_seconds(llm, prompt, 1))
        if llama_bench is not None:
            tests = run_llama_bench(llama_bench, path, threads, tokens, 0, 1)["tests"]
            samples["llama.cpp"].append(tests[f"pp{tokens}"]["best_tok_s"])
        print("  repeat: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in samples.items() if v), flush=True)
    print(
        f"{path.name}: prefill {tokens} tokens, {threads} threads, {repeats} repeats (tok/s, median (min-max))"
    )
    for name, values in samples.items():
        if values:
            ratio = ""
            if samples["llama.cpp"]:
                ratio = f"  {statistics.median(values) / statistics.median(samples['llama.cpp']):.2f}x pp"
            print(f"  {name:<10} {spread(values)}{ratio}")


def main(argv: list[str] | None = None) -> int:
    """Run the kernels' table, the prefill figure, or both."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kernels", action="store_true", help="the GEMM at a Q4_K_M file's shapes")
    parser.add_argument("--model", type=Path, default=None, help="a GGUF file for the prefill figure")
    parser.add_argument("--llama-bench", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=512, help="rows of x in the kernels' table")
    parser.add_argument("--tokens", type=int, default=512, help="the prefill's prompt (pp512)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not cpu_grouped.available():
        raise SystemExit("no C compiler: the CPU kernels are not built")
    torch.set_num_threads(args.threads)
    if args.kernels:
        kernels(args.rows, args.repeats)
    if args.model is not None:
        prefill(args.model, args.llama_bench, args.threads, args.tokens, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
