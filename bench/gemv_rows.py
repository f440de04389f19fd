"""How the CPU quantized GEMV and the whole C decode step scale with rows (M), one thread, on the embedded
SmolLM2-135M Q4_1 GGUF: the time at M rows over the time at M = 1.

1. The grouped matmul (kernels/cpu_grouped.py) on each kind of the model's weights: layer 0's qkv (Q4_1
   960 x 576), o (Q4_1 576 x 576), gate_up (Q4_1 3072 x 576), down (Q4_1 576 x 1536) and the LM head (the tied
   Q8_0 embedding, 49152 x 576), with int8 activations (`matmul_int8`, the decode step's default) and float32
   ones (`matmul`).
2. The whole C decode step (engine/cpu_decode.py) at M rows of distinct prompts: bench/decode.py's bare
   forward loop, seconds a step.

Beside each matmul row, its time as a line in M fitted over the rows measured: ns a block of 16 weight rows by
one group of 32 shared by every row of x (loading, unpacking and transposing the codes, their scales) and ns a
row adds (its integer dot products and their float scaling). The call's fixed cost (Python, ctypes, quantizing
x) lands in the shared part, which is why the small matrices show more of it than the LM head. At M rows the
kernel costs (shared + M x per_row) against (shared + per_row) at one: the shared part is what batching spreads.

Each figure is the best of --repeats runs, the sizes interleaved so that background load hits all alike. The
speculative-decoding goal (verifying k draft tokens runs M = k + 1 rows): the step at M = 4 within 1.6x and at
M = 8 within 2.5x the M = 1 time. To compare kernels, run this on each commit in the same session.

    PYTHONPATH=src:tests:bench .venv/bin/python bench/gemv_rows.py [--rows 1 2 4 8] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from decode import bare_decode, distinct_prompts  # noqa: E402
from swarmkv import LLM  # noqa: E402
from swarmkv.kernels import cpu_grouped  # noqa: E402
from swarmkv.models.gguf_linear import GGUFLinear  # noqa: E402
from swarmkv.models.loader import load_model, resolve_model_path  # noqa: E402


def seconds_a_call(
    kernel: Callable[[torch.Tensor, cpu_grouped.GroupedQuant], torch.Tensor],
    x: torch.Tensor,
    weight_blocks: list[cpu_grouped.GroupedQuant],
    calls: int,
) -> float:
    """Seconds of one `kernel` call over every block of a weight, over `calls` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(calls):
        for w in weight_blocks:
            kernel(x, w)
    return (time.perf_counter() - start) / calls


def blocks(module: object) -> list[cpu_grouped.GroupedQuant]:
    """The quantized row blocks of a GGUF-held layer."""
    assert isinstance(module, GGUFLinear)
    return [b.weight for b in module.blocks]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=16, help="decode steps a timed run")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--no-step", action="store_true", help="the matmuls only")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    loaded = load_model(resolve_model_path(None), dtype="float32", weights="gguf")
    model = loaded.model
    weights = {
        "qkv": blocks(model.layers[0].self_attn.qkv_proj),
        "o": blocks(model.layers[0].self_attn.o_proj),
        "gate_up": blocks(model.layers[0].mlp.gate_up_proj),
        "down": blocks(model.layers[0].mlp.down_proj),
        "lm_head": blocks(model.lm_head),
    }
    generator = torch.Generator().manual_seed(0)
    inputs = {
        (name, m): torch.randn(m, ws[0].shape[1], generator=generator)
        for name, ws in weights.items()
        for m in args.rows
    }
    kernels: dict[str, Callable[[torch.Tensor, cpu_grouped.GroupedQuant], torch.Tensor]] = {
        "int8": cpu_grouped.matmul_int8,
        "float": cpu_grouped.matmul,
    }
    samples: dict[tuple[str, str, int], list[float]] = {}
    llm = None
    if not args.no_step:
        llm = LLM(loaded=loaded, prefix_caching=False, kv_cache_memory="256MiB", max_num_seqs=max(args.rows))
        assert llm.engine.runner.cpu_decode is not None, "the C decode step does not run this model"
        prompts = {
            m: distinct_prompts(m, args.prompt_tokens, loaded.config.vocab_size, seed=m) for m in args.rows
        }
        bare_decode(loaded, llm.engine.runner.kv_cache, prompts[1], 2, True)  # warm-up
    for _ in range(args.repeats):
        for (name, m), x in inputs.items():
            for kind, kernel in kernels.items():
                calls = max(2, 200 // m) if name != "lm_head" else max(2, 20 // m)
                seconds = seconds_a_call(kernel, x, weights[name], calls)
                samples.setdefault((kind, name, m), []).append(seconds)
        if llm is not None:
            for m in args.rows:
                cache = llm.engine.runner.kv_cache
                seconds = bare_decode(loaded, cache, prompts[m], args.decode_tokens, True)[0]
                samples.setdefault(("step", "decode", m), []).append(seconds / args.decode_tokens)
    print(
        f"one thread, best of {args.repeats}; ms at M rows, and over M = 1; ns a 16 x 32 block: shared + a row"
    )
    print(
        f"{'kernel':>6} {'matrix':>8} "
        + " ".join(f"{'M=' + str(m):>16}" for m in args.rows)
        + f" {'shared':>7} {'a row':>6}"
    )
    for kind, name in dict.fromkeys((k, n) for k, n, _ in samples):
        base = min(samples[(kind, name, args.rows[0])])
        best = [min(samples[(kind, name, m)]) for m in args.rows]
        cells = [f"{t * 1e3:8.3f} {t / base:6.2f}x" for t in best]
        fit = ""
        if name in weights and len(set(args.rows)) > 1:  # a line needs two distinct row counts
            num_blocks = sum(w.shape[0] * w.shape[1] for w in weights[name]) / (16 * 32)
            shared, per_row = line_fit(args.rows, [t / num_blocks * 1e9 for t in best])
            fit = f" {shared:7.2f} {per_row:6.2f}"
        print(f"{kind:>6} {name:>8} " + " ".join(f"{c:>16}" for c in cells) + fit)
    return 0


def line_fit(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points (xs at least two distinct values)."""
    assert len(set(xs)) > 1, "a line needs two distinct row counts"
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread
    return mean_y - slope * mean_x, slope


if __name__ == "__main__":
    raise SystemExit(main())
