"""swarmkv against llama.cpp on the same GGUF files, the two interleaved in one sitting: each figure's median and
spread over the repeats, beside the machine's memory bandwidth (a copy loop, and a read loop) and the decode ceiling
the read rate implies for each file. Made for the Qwen3.5 files `bench/qwen35_files.py` makes; any GGUF both engines run
will do.

Like for like:
- the file's own bits (swarmkv's default on the CPU), float16 KV (as llama.cpp keeps it), the same threads;
- prefill: 512 tokens with no prefix hit (prefix caching off), the time of `generate` with max_tokens=1, against
  llama-bench's pp512;
- decode: one request, speculation off (llama-bench drafts nothing), 128 tokens: the time of 129 greedy tokens less
  that of 1 from a 64-token prompt, against tg128;
- batch B (8): B distinct 64-token prompts decoded together, B x 128 tokens over the same difference, against
  llama-batched-bench's aggregate decode (S_TG) at B with the same lengths.
Random weights' greedy replies repeat, which a drafter would turn into a speedup that says nothing: speculation
stays off. Each repeat runs swarmkv's three figures, then llama-bench once (-r 1), then llama-batched-bench, so
background load falls on both alike.

With two files of one shape that differ only in their layer count (`qwen35_files.py --shape 9b`), the per-layer
decode time (t(L2) - t(L1)) / (L2 - L1) of each engine is printed too: the vocabulary's head cancels out.

    .venv/bin/python bench/versus_llama.py --model FILE [FILE ...] --llama-bench PATH [--repeats 3]
        [--batch 8] [--threads 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from decode import distinct_prompts, find_batched_bench, generate_seconds, run_batched_bench, run_llama_bench  # noqa: E402
from swarmkv import LLM  # noqa: E402
from swarmkv.models.gguf_file import open_gguf  # noqa: E402

PROMPT_TOKENS = 64  # each decode prompt


def bandwidth_gb_s(megabytes: int = 512, repeats: int = 5) -> tuple[float, float]:
    """(bytes read plus written per second by a float32 copy of `megabytes`, bytes read per second by a sum over
    them), the best of `repeats` each, in GB/s. A decode step reads its weights: the read rate bounds it."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.zeros_like(src)  # written once first, so the copy pays no page faults
    copy = read = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        copy = min(copy, time.perf_counter() - start)
        start = time.perf_counter()
        src.sum()
        read = min(read, time.perf_counter() - start)
    nbytes = src.numel() * 4
    return 2 * nbytes / copy / 1e9, nbytes / read / 1e9


def decoded_bytes(path: Path) -> tuple[int, int]:
    """(bytes of the file's tensors a decode step reads, its layer count): every tensor but the MTP layer's (the
    nextn block, which neither engine runs here) and the token embedding's, unless the head is tied to it."""
    gguf = open_gguf(path)
    arch, reader = gguf.architecture, gguf.reader
    blocks = int(gguf.metadata[f"{arch}.block_count"])
    mtp = int(gguf.metadata.get(f"{arch}.nextn_predict_layers", 0))
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    total = 0
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk" and int(parts[1]) >= blocks - mtp:
            continue
        if t.name == "token_embd.weight" and not tied:
            continue
        total += int(t.n_bytes)
    return total, blocks - mtp


def spread(samples: list[float]) -> dict[str, float]:
    """Median, least and most of a figure's samples."""
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def measure_file(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Every repeat of both engines on one file, interleaved."""
    batch = args.batch
    llm = LLM(
        str(path),
        dtype="float32",
        prefix_caching=False,  # every prefill computes its whole prompt
        speculation="off",
        max_num_seqs=batch,
        kv_cache_memory="1GiB",
        state_memory="512MiB",
    )
    vocab = llm.loaded.config.vocab_size
    one = distinct_prompts(1, PROMPT_TOKENS, vocab, seed=1)
    many = distinct_prompts(batch, PROMPT_TOKENS, vocab, seed=batch)
    long_prompt = distinct_prompts(1, args.prefill_tokens, vocab, seed=1000)
    generate_seconds(llm, one, 2)  # warm-up
    batched_tool = find_batched_bench(args.llama_bench) if args.llama_bench else None
    ours: dict[str, list[float]] = {"prefill": [], "decode": [], f"batch{batch}": []}
    theirs: dict[str, list[float]] = {"pp": [], "tg": [], f"batch{batch}": []}  # pp512 and tg128 by default
    for _ in range(args.repeats):
        ours["prefill"].append(args.prefill_tokens / generate_seconds(llm, long_prompt, 1))
        short, long = generate_seconds(llm, one, 1), generate_seconds(llm, one, args.decode_tokens + 1)
        ours["decode"].append(args.decode_tokens / (long - short))
        short, long = generate_seconds(llm, many, 1), generate_seconds(llm, many, args.decode_tokens + 1)
        ours[f"batch{batch}"].append(batch * args.decode_tokens / (long - short))
        if args.llama_bench is None:
            continue
        tests = run_llama_bench(
            args.llama_bench, path, args.threads, args.prefill_tokens, args.decode_tokens, 1
        )["tests"]
        theirs["pp"].append(tests[f"pp{args.prefill_tokens}"]["best_tok_s"])
        theirs["tg"].append(tests[f"tg{args.decode_tokens}"]["best_tok_s"])
        if batched_tool is not None:
            rates = run_batched_bench(
                batched_tool, path, args.threads, PROMPT_TOKENS, args.decode_tokens, [batch]
            )
            theirs[f"batch{batch}"].append(rates["decode_tok_s"][batch])
    nbytes, layers = decoded_bytes(path)
    return {
        "file": str(path),
        "layers": layers,
        "decode_bytes": nbytes,
        "kv_dtype": str(llm.engine.runner.kv_cache.storage_dtype),
        "c_decode_step": llm.engine.runner.cpu_decode is not None,
        "swarmkv": {name: spread(samples) for name, samples in ours.items()},
        "llama.cpp": {name: spread(samples) for name, samples in theirs.items() if samples},
        "ratios": {
            "prefill_vs_pp": _ratio(ours["prefill"], theirs["pp"]),
            "decode_vs_tg": _ratio(ours["decode"], theirs["tg"]),
            f"batch{batch}_vs_batched_bench": _ratio(ours[f"batch{batch}"], theirs[f"batch{batch}"]),
        },
    }


def _ratio(a: list[float], b: list[float]) -> float | None:
    return statistics.median(a) / statistics.median(b) if a and b else None


def per_layer(results: list[dict[str, Any]]) -> dict[str, float] | None:
    """Each engine's decode time a layer over the two files of the fewest and most layers (ms), and their ratio."""
    if len(results) < 2:
        return None
    low, high = min(results, key=lambda r: r["layers"]), max(results, key=lambda r: r["layers"])
    if low["layers"] == high["layers"]:
        return None
    span = high["layers"] - low["layers"]

    def ms(r: dict[str, Any], engine: str, key: str) -> float | None:
        figure = r[engine].get(key)
        return None if figure is None else 1e3 / figure["median"]

    out: dict[str, float] = {}
    for engine, key in (("swarmkv", "decode"), ("llama.cpp", "tg")):
        a, b = ms(low, engine, key), ms(high, engine, key)
        if a is not None and b is not None:
            out[engine] = (b - a) / span
    if "swarmkv" in out and "llama.cpp" in out:
        out["ratio"] = out["swarmkv"] / out["llama.cpp"]
    return out


def cpu_flags() -> str:
    """The CPU's model and the vector features that pick the kernels."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    model = next(
        (line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?"
    )
    flags = next(
        (line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []
    )
    wanted = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "avx_vnni")
    return f"{model} [{' '.join(f for f in wanted if f in flags)}]"


def main(argv: list[str] | None = None) -> int:
    """Measure every file, print the table, write --json."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, nargs="+", required=True, help="GGUF files")
    parser.add_argument(
        "--llama-bench", type=Path, default=None, help="llama-bench (batched-bench beside it)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-tokens", type=int, default=512, help="the prefill figure's prompt (pp512)")
    parser.add_argument(
        "--decode-tokens", type=int, default=128, help="tokens each decode figure times (tg128)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    copy, read = bandwidth_gb_s()
    print(
        f"{cpu_flags()}, {args.threads} threads; copy loop {copy:.1f} GB/s (read + written), read loop {read:.1f} GB/s"
    )
    results = []
    for path in args.model:
        r = measure_file(path, args)
        r["decode_ceiling_tok_s"] = read * 1e9 / r["decode_bytes"]
        results.append(r)
        print(
            f"\n{path.name}: {r['layers']} layers, {r['decode_bytes'] / 2**20:.0f} MiB read a decode step "
            f"(ceiling at the read rate: {r['decode_ceiling_tok_s']:.1f} tok/s); C step {r['c_decode_step']}, "
            f"KV {r['kv_dtype']}"
        )
        print(f"{'figure':<22} {'swarmkv (median, min-max)':>28} {'llama.cpp':>28} {'ratio':>7}")
        pairs = (
            ("prefill", "prefill", "pp", "prefill_vs_pp"),
            ("decode, one request", "decode", "tg", "decode_vs_tg"),
            (
                f"decode, batch {args.batch}",
                f"batch{args.batch}",
                f"batch{args.batch}",
                f"batch{args.batch}_vs_batched_bench",
            ),
        )
        for label, ours_key, theirs_key, ratio_key in pairs:
            a, b, ratio = r["swarmkv"][ours_key], r["llama.cpp"].get(theirs_key), r["ratios"][ratio_key]
            them = f"{b['median']:.1f} ({b['min']:.1f}-{b['max']:.1f})" if b else "-"
            print(
                f"{label:<22} {a['median']:>12.1f} ({a['min']:.1f}-{a['max']:.1f}) tok/s {them:>22} "
                f"{'-' if ratio is None else f'{ratio:.2f}x':>7}"
            )
    layer = per_layer(results)
    if layer:
        print("\ndecode time a layer (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in layer.items()))
    if args.json:
        record = {
            "cpu": cpu_flags(),
            "threads": args.threads,
            "copy_gb_s": copy,
            "read_gb_s": read,
            "files": results,
            "per_layer": layer,
        }
        args.json.write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
