"""Decode tokens/s of swarmkv on the embedded SmolLM2-135M Q4_1 GGUF (CPU), one request and batched, beside the
bare forward loop, against transformers and llama.cpp in the same run.

1. `LLM.generate`, one request (sampling and detokenizing included, prefill excluded): the time of N + 1
   greedy tokens less that of 1 token from the same prompt, N tokens over the difference.
2. The bare forward loop beside it: what the runner computes for a decode step, greedy argmax, against the
   engine's own KV cache tensors: the C decode step (engine/cpu_decode.py) where the engine runs it (a dense
   model held at its GGUF bits), over a page table of contiguous pages; else the model forward and LM head
   through the torch backend (`PagedAttention`) with the decode layout the runner builds (one `DecodeGroup` a
   step, over contiguous slots). No scheduler, sampler or detokenizer: generate/bare is the share of a step
   that is the model. Beside it, the C step with a single int8 pass (`cpu_int8_residual_groups=0`, as
   llama.cpp rounds): what the default's second pass over each row's largest groups costs.
3. Aggregate decode tokens/s at batch 1 to 16: B distinct prompts of equal length through one `generate` call,
   B x N tokens over the same difference, each against batch 1 (issue 26's target: batch 8 >= 4x batch 1).
4. transformers `generate` over the same GGUF (dequantised to float32, SDPA), greedy, at batch 1 and 8, the
   same difference; swarmkv/transformers at each.
5. llama.cpp's `llama-bench -t <torch threads> -p 512 -n 128` on the same file, when it is on the PATH (or
   given with --llama-bench): swarmkv's one-request decode against tg128, and its prefill of 512 tokens (the
   time of `generate` with max_tokens=1) against pp512. llama-bench's best repetition is taken, as ours are.
   Beside it, when `llama-batched-bench` sits next to llama-bench (or is on the PATH), llama.cpp's aggregate
   decode at the same batch sizes, prompt and decode lengths (its S_TG, one run): swarmkv's `generate`
   against it at each batch, and llama.cpp's own batch-8 scaling against its batch 1.

Every timed figure is the best of --repeats runs after one warm-up, weight formats and transformers
interleaved so that background load hits all alike. Prefix caching is off, so every run computes its whole
prompt and the two runs of a difference prefill alike. Beside other load on a 2-core machine, runs with 2 torch
threads slow by 10-50x at times (a thread waits on a descheduled peer at every op): compare the samples in
--json, raise --repeats, or take --threads 1, which degrades gracefully. A default run should take about 2 minutes
on an idle 2-core CPU (summed from the best samples of a loaded run).

    .venv/bin/python bench/decode.py [--weights gguf int4 float] [--decode-tokens 64] [--repeats 2]
        [--batches 1 2 4 8 16] [--llama-bench PATH] [--json decode.json] [--quick]

"gguf" (the CPU default) holds every tensor at the file's bits; "int4" puts the Q4_1 projections in PyTorch's
int4 kernel with a float32 embedding and LM head; "float" dequantises everything to float32.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from swarmkv import LLM, SamplingParams  # noqa: E402
from swarmkv.choices import CPU_INT8_RESIDUAL_GROUPS  # noqa: E402
from swarmkv.engine import cpu_decode  # noqa: E402
from swarmkv.engine.kv_cache import KVCache  # noqa: E402
from swarmkv.engine.page_table import PageTable  # noqa: E402
from swarmkv.engine.paged_attention import DecodeGroup, PagedAttention, PrefillSpan, StepLayout  # noqa: E402
from swarmkv.models.loader import LoadedModel, load_model, resolve_model_path  # noqa: E402

WEIGHTS = ("gguf", "int4", "int8", "float")
TARGET_BATCH8 = 4.0  # issue 26: aggregate decode at batch 8 against batch 1
TARGET_TG = 1.0  # one request's decode against llama.cpp's tg128
TARGET_PP = 1.5  # prefill 512 against llama.cpp's pp512
BUILD_HINT = (
    "build it from the llama-cpp-python source distribution: "
    "pip download --no-binary :all: --no-deps llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz && "
    "cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF && "
    "cmake --build build --target llama-bench -j; then pass --llama-bench build/bin/llama-bench"
)


def distinct_prompts(num_prompts: int, num_tokens: int, vocab_size: int, seed: int) -> list[list[int]]:
    """`num_prompts` prompts of `num_tokens` random token ids each, none sharing a first page with another."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, vocab_size - 100, (num_prompts, num_tokens), generator=generator)
    return ids.tolist()


def decode_tok_s(num_rows: int, num_tokens: int, long_s: float, short_s: float) -> float | None:
    """Aggregate decode tokens/s from a run of `num_tokens` + 1 tokens a row and one of 1 token; None when
    noise made the longer run no slower."""
    extra_s = long_s - short_s
    return num_rows * num_tokens / extra_s if extra_s > 0 else None


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either is missing or b is not positive."""
    return a / b if a is not None and b is not None and b > 0 else None


def times(value: float | None) -> str:
    """A ratio as printed: '1.23x', or '-' when missing."""
    return "-" if value is None else f"{value:.2f}x"


def rate(value: float | None) -> str:
    """A tokens/s figure as printed, or '-' when missing."""
    return "-" if value is None else f"{value:.1f}"


class Timings:
    """Seconds of every labelled run over the repeats; the best (least) is the figure."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)

    def add(self, key: str, seconds: float) -> None:
        """Record one run."""
        self.samples[key].append(seconds)

    def best(self, key: str) -> float:
        """The least seconds recorded under `key`."""
        return min(self.samples[key])


def generate_seconds(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Seconds of one `generate` of every prompt to `max_tokens` greedy tokens, EOS ignored."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(o.error is None and len(o.token_ids) == max_tokens for o in outputs), [
        o.error for o in outputs
    ]
    return elapsed


@torch.inference_mode()
def bare_decode(
    loaded: LoadedModel,
    cache: KVCache,
    prompts: list[list[int]],
    num_tokens: int,
    fused: bool = False,
    page_size: int = 16,
    residual_groups: int = CPU_INT8_RESIDUAL_GROUPS,
) -> tuple[float, list[list[int]]]:
    """Seconds of `num_tokens` greedy decode steps of every prompt at once (after their untimed prefill):
    the model forward over `cache` through `PagedAttention`, the LM head for one row each, and argmax; or, if
    `fused`, the C decode step over a page table of contiguous pages (its int8 residual pass over
    `residual_groups` groups a row, the engine's default unless given); and each prompt's tokens (the prefill's, then
    the decodes')."""
    model, device, dtype = loaded.model, loaded.device, loaded.dtype
    lengths = torch.tensor([len(p) for p in prompts])
    pages_per_row = -(-(int(lengths.max()) + num_tokens + 1) // page_size)
    span = pages_per_row * page_size  # slots per row: row b owns [b * span, (b + 1) * span)
    assert len(prompts) * span <= cache.k.shape[1], "the KV pool is too small for the bare loop"
    base = torch.arange(len(prompts)) * span
    positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
    rows = torch.repeat_interleave(torch.arange(len(prompts)), lengths)
    starts = (torch.cumsum(lengths, 0) - lengths).tolist()
    layout = StepLayout(
        (base[rows] + positions).to(device),
        tuple(PrefillSpan(s, n, None, None) for s, n in zip(starts, lengths.tolist(), strict=True)),
        (),
    )
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    hidden = model(ids, positions.to(device), PagedAttention(cache, layout))
    last = torch.cumsum(lengths, 0) - 1
    tokens = model.compute_logits(hidden[last.to(device)]).argmax(-1)
    steps = [tokens]
    if fused:
        table = PageTable(len(prompts), pages_per_row, page_size, device)
        for b in range(len(prompts)):
            table.append(f"row{b}", list(range(b * pages_per_row, (b + 1) * pages_per_row)))
        c_step = cpu_decode.describe(
            model, cache, table, int8_activations=True, residual_groups=residual_groups
        )
        rows, ones, nothing = torch.arange(len(prompts)), [1] * len(prompts), [0] * len(prompts)
        start = time.perf_counter()
        for step in range(num_tokens):
            tokens = c_step.step(tokens, rows, lengths + step, ones, nothing).argmax(-1)
            steps.append(tokens)
        return time.perf_counter() - start, torch.stack(steps, 1).tolist()
    start = time.perf_counter()
    for step in range(num_tokens):
        pos = lengths + step
        width = int(pos.max()) + 1
        keys = torch.arange(width)
        bias = torch.zeros(len(prompts), width, dtype=dtype).masked_fill_(
            keys[None] > pos[:, None], float("-inf")
        )
        group = DecodeGroup(0, (base[:, None] + keys[None]).to(device), bias[:, None, None, :].to(device))
        layout = StepLayout((base + pos).to(device), (), (group,))
        hidden = model(tokens, pos.to(device), PagedAttention(cache, layout))
        tokens = model.compute_logits(hidden).argmax(-1)
        steps.append(tokens)
    tokens.tolist()  # waits for the last step (a no-op on the CPU, where every op is synchronous)
    elapsed = time.perf_counter() - start
    return elapsed, torch.stack(steps, 1).tolist()


def load_transformers(path: Path) -> Any:
    """transformers' own reading of the GGUF at `path`, dequantised to float32, with SDPA attention."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@torch.inference_mode()
def transformers_seconds(model: Any, prompts: list[list[int]], num_tokens: int) -> float:
    """Seconds of one greedy `generate` of every prompt (equal lengths, no padding) to `num_tokens` tokens."""
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    elapsed = time.perf_counter() - start
    assert out.shape == (len(prompts), ids.shape[1] + num_tokens), out.shape
    return elapsed


def find_llama_bench(given: str | None) -> Path | None:
    """The llama-bench binary: `given` (which must exist), else the one on the PATH, else None."""
    if given is not None:
        path = Path(given).expanduser()
        if not path.is_file():
            raise SystemExit(f"--llama-bench {given}: no such file")
        return path
    found = shutil.which("llama-bench")
    return Path(found) if found else None


def parse_llama_bench(text: str) -> dict[str, dict[str, float]]:
    """llama-bench's `-o json` as {test: {"best_tok_s", "avg_tok_s"}}, tests named as llama-bench prints
    them: pp512 (prompt only), tg128 (generation only), pp512+tg128 (both)."""
    tests: dict[str, dict[str, float]] = {}
    for record in json.loads(text):
        n_prompt, n_gen = int(record["n_prompt"]), int(record["n_gen"])
        name = "+".join(
            part for part in (f"pp{n_prompt}" * bool(n_prompt), f"tg{n_gen}" * bool(n_gen)) if part
        )
        samples = [float(s) for s in record.get("samples_ts") or [record["avg_ts"]]]
        tests[name] = {"best_tok_s": max(samples), "avg_tok_s": float(record["avg_ts"])}
    return tests


def run_tool(binary: Path, model: Path, threads: int, *args: str) -> tuple[list[str], str]:
    """Run a llama.cpp tool on `model` with `threads`: its command and its stdout."""
    command = [str(binary), "-m", str(model), "-t", str(threads), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
    return command, done.stdout


def run_llama_bench(
    binary: Path, model: Path, threads: int, prompt_tokens: int, gen_tokens: int, repetitions: int | None
) -> dict[str, Any]:
    """Run llama-bench on `model`; its command and parsed tests."""
    args = ["-p", str(prompt_tokens), "-n", str(gen_tokens), "-o", "json"]
    args += ["-r", str(repetitions)] if repetitions else []
    command, out = run_tool(binary, model, threads, *args)
    return {"command": command, "tests": parse_llama_bench(out)}


def find_batched_bench(llama_bench: Path) -> Path | None:
    """llama-batched-bench beside `llama_bench` (the same build), else on the PATH, else None."""
    beside = llama_bench.with_name("llama-batched-bench")
    if beside.is_file():
        return beside
    found = shutil.which("llama-batched-bench")
    return Path(found) if found else None


def run_batched_bench(
    binary: Path, model: Path, threads: int, prompt_tokens: int, decode_tokens: int, batches: list[int]
) -> dict[str, Any]:
    """llama-batched-bench's aggregate decode tok/s (S_TG) at each batch: B sequences of `prompt_tokens`
    prefilled, then `decode_tokens` each decoded together."""
    context = max(batches) * (prompt_tokens + decode_tokens) + 64
    args = [
        "-c",
        str(context),
        "-b",
        "512",
        "-ub",
        "512",
        "-npp",
        str(prompt_tokens),
        "-ntg",
        str(decode_tokens),
    ]
    args += ["-npl", ",".join(map(str, batches)), "--output-format", "jsonl"]
    command, out = run_tool(binary, model, threads, *args)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {"command": command, "decode_tok_s": {int(r["pl"]): float(r["speed_tg"]) for r in lines}}


def compare_batched(record: dict[str, Any], batched: dict[str, Any]) -> None:
    """Add swarmkv's aggregate decode against llama.cpp's at each batch, per format, and llama.cpp's scaling."""
    theirs = batched["decode_tok_s"]
    batched["vs_batch1"] = {b: ratio(r, theirs.get(1)) for b, r in theirs.items()}
    batched["versus"] = {
        fmt: {b: ratio(row["generate_tok_s"], theirs.get(b)) for b, row in f["batches"].items()}
        for fmt, f in record["formats"].items()
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line, with --quick's smaller sizes filled in."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--weights", nargs="+", default=["gguf"], choices=WEIGHTS, help="formats to compare")
    parser.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2)")
    parser.add_argument("--decode-tokens", type=int, default=None, help="decode tokens timed a row (64)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="tokens of each decode prompt (64)")
    parser.add_argument("--prefill-tokens", type=int, default=None, help="the prefill prompt (512)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (1 2 4 8 16)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs of each figure (2)")
    parser.add_argument(
        "--transformers-batches", type=int, nargs="*", default=None, help="batches for transformers (1 8)"
    )
    parser.add_argument("--llama-bench", default=None, help="the llama-bench binary (default: on the PATH)")
    parser.add_argument("--no-llama-bench", action="store_true", help="skip llama.cpp even if found")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", default=None, help="write every figure here")
    parser.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, one repeat")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults: dict[str, Any] = {
        "decode_tokens": 8 if quick else 64,
        "prompt_tokens": 16 if quick else 64,
        "prefill_tokens": 64 if quick else 512,
        "batches": [1, 2] if quick else [1, 2, 4, 8, 16],
        "repeats": 1 if quick else 2,
        "transformers_batches": [1] if quick else [1, 8],
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if 1 not in args.batches:
        args.batches = [1, *args.batches]  # every batch is reported against batch 1
    args.llama_gen_tokens = 16 if quick else 128
    args.llama_repetitions = 1 if quick else None  # llama-bench's own default (5) otherwise
    return args


def state_memory(loaded: LoadedModel, args: argparse.Namespace) -> int | None:
    """A hybrid's recurrent-state bytes: a slot for each row of the largest batch and two spare (None: dense)."""
    per_sequence = loaded.config.state_bytes_per_sequence(loaded.dtype)
    return per_sequence * (max(args.batches) + 2) if per_sequence else None


def kv_cache_memory(loaded: LoadedModel, args: argparse.Namespace) -> int:
    """KV pool bytes for the largest batch's runs (or the prefill prompt), with room for page rounding, and a
    hybrid's state slots beside them (they come out of the same budget)."""
    row_tokens = args.prompt_tokens + args.decode_tokens + 2 * 16  # two pages' slack a row
    tokens = max(max(args.batches) * row_tokens, args.prefill_tokens + 2 * 16)
    pages = int(tokens * loaded.config.kv_bytes_per_token(loaded.dtype) * 1.25)
    return pages + (state_memory(loaded, args) or 0)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every timed run, interleaved over formats and transformers; the figures derived from the best of each."""
    path = resolve_model_path(args.model)
    models = {fmt: load_model(path, dtype="float32", weights=fmt) for fmt in args.weights}
    first = next(iter(models.values()))
    llms = {
        fmt: LLM(
            loaded=m,
            prefix_caching=False,
            kv_cache_memory=kv_cache_memory(m, args),
            state_memory=state_memory(m, args),
            max_num_seqs=max(args.batches),
            speculation="off",  # decode itself, against llama.cpp's tg128, which drafts nothing
        )
        for fmt, m in models.items()
    }
    hf = load_transformers(path) if args.transformers_batches else None
    vocab = first.config.vocab_size
    every_batch = sorted({*args.batches, *args.transformers_batches})
    prompts = {b: distinct_prompts(b, args.prompt_tokens, vocab, seed=b) for b in every_batch}
    prefill_prompt = distinct_prompts(1, args.prefill_tokens, vocab, seed=1000)
    n = args.decode_tokens
    timings = Timings()
    # The bare loop drives a dense model's KV alone; a hybrid's steps also carry state slots, so it has none.
    bare_loop = {fmt: not m.config.is_hybrid for fmt, m in models.items()}
    for fmt, llm in llms.items():  # warm-up: one short run of each kind
        generate_seconds(llm, prompts[1], 2)
        if bare_loop[fmt]:
            bare_decode(
                models[fmt],
                llm.engine.runner.kv_cache,
                prompts[1],
                2,
                llm.engine.runner.cpu_decode is not None,
            )
    if hf is not None:
        transformers_seconds(hf, prompts[1], 2)
    for _ in range(args.repeats):
        for fmt, llm in llms.items():
            cache = llm.engine.runner.kv_cache  # free between runs: prefix caching is off
            for b in args.batches:
                timings.add(f"{fmt} b{b} short", generate_seconds(llm, prompts[b], 1))
                timings.add(f"{fmt} b{b} long", generate_seconds(llm, prompts[b], n + 1))
                fused = llm.engine.runner.cpu_decode is not None
                if not bare_loop[fmt]:
                    continue
                timings.add(f"{fmt} b{b} bare", bare_decode(models[fmt], cache, prompts[b], n, fused)[0])
                if fused:  # the C step with llama.cpp's single int8 pass: what the residual pass costs
                    one = bare_decode(models[fmt], cache, prompts[b], n, fused, residual_groups=0)[0]
                    timings.add(f"{fmt} b{b} bare one pass", one)
            timings.add(f"{fmt} prefill", generate_seconds(llm, prefill_prompt, 1))
        if hf is not None:
            for b in args.transformers_batches:
                timings.add(f"transformers b{b} short", transformers_seconds(hf, prompts[b], 1))
                timings.add(f"transformers b{b} long", transformers_seconds(hf, prompts[b], n + 1))

    def engine_rate(label: str, b: int) -> float | None:
        return decode_tok_s(b, n, timings.best(f"{label} b{b} long"), timings.best(f"{label} b{b} short"))

    theirs = {b: engine_rate("transformers", b) for b in args.transformers_batches} if hf is not None else {}
    formats: dict[str, Any] = {}
    for fmt in models:
        ours = {b: engine_rate(fmt, b) for b in args.batches}
        bare = {b: b * n / timings.best(f"{fmt} b{b} bare") if bare_loop[fmt] else None for b in args.batches}
        single = {
            b: b * n / timings.best(f"{fmt} b{b} bare one pass")
            for b in args.batches
            if f"{fmt} b{b} bare one pass" in timings.samples
        }
        formats[fmt] = {
            "prefill_tok_s": args.prefill_tokens / timings.best(f"{fmt} prefill"),
            "batches": {
                b: {
                    "generate_tok_s": ours[b],
                    "bare_tok_s": bare[b],
                    "generate_over_bare": ratio(ours[b], bare[b]),
                    "vs_batch1": ratio(ours[b], ours[1]),
                    "bare_vs_batch1": ratio(bare[b], bare[1]),
                    "one_pass_tok_s": single.get(b),
                    "one_pass_vs_batch1": ratio(single.get(b), single.get(1)),
                    "transformers_tok_s": theirs.get(b),
                    "over_transformers": ratio(ours[b], theirs.get(b)),
                }
                for b in args.batches
            },
        }
    return {
        "config": {
            "model": f"{first.name} ({path.name})",
            "path": str(path),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "decode_tokens": n,
            "prompt_tokens": args.prompt_tokens,
            "prefill_tokens": args.prefill_tokens,
            "repeats": args.repeats,
        },
        "formats": formats,
        "transformers": {b: {"decode_tok_s": r} for b, r in theirs.items()},
        "seconds": {key: samples for key, samples in timings.samples.items()},
    }


def compare_llama(
    record: dict[str, Any], llama: dict[str, Any], prefill_tokens: int, gen_tokens: int
) -> None:
    """Add swarmkv's one-request decode against tg and its prefill against pp, per format, to `record`."""
    tests = llama["tests"]
    tg = tests.get(f"tg{gen_tokens}", {}).get("best_tok_s")
    pp = tests.get(f"pp{prefill_tokens}", {}).get("best_tok_s")
    llama["versus"] = {
        fmt: {
            "decode_over_tg": ratio(f["batches"][1]["generate_tok_s"], tg),
            "prefill_over_pp": ratio(f["prefill_tok_s"], pp),
        }
        for fmt, f in record["formats"].items()
    }


def targets(record: dict[str, Any], gen_tokens: int, prefill_tokens: int) -> list[dict[str, Any]]:
    """Issue 26's targets that this run measures, each with its ratio and whether it is met."""
    out = []
    for fmt, f in record["formats"].items():
        if 8 in f["batches"]:
            out.append(
                {
                    "what": f"{fmt}: decode at batch 8 against batch 1",
                    "ratio": f["batches"][8]["vs_batch1"],
                    "target": TARGET_BATCH8,
                }
            )
        versus = record.get("llama_bench", {}).get("versus", {}).get(fmt)
        if versus:
            out.append(
                {
                    "what": f"{fmt}: one request's decode against llama.cpp tg{gen_tokens}",
                    "ratio": versus["decode_over_tg"],
                    "target": TARGET_TG,
                }
            )
            out.append(
                {
                    "what": f"{fmt}: prefill {prefill_tokens} against llama.cpp pp{prefill_tokens}",
                    "ratio": versus["prefill_over_pp"],
                    "target": TARGET_PP,
                }
            )
    for t in out:
        t["met"] = t["ratio"] is not None and t["ratio"] >= t["target"]
    return out


def print_report(record: dict[str, Any]) -> None:
    """The tables."""
    config = record["config"]
    threads = f"{config['threads']} thread" + "s" * (config["threads"] != 1)
    print(
        f"{config['model']}, CPU, {threads}; {config['prompt_tokens']}-token prompts, "
        f"{config['decode_tokens']} greedy decode tokens a row; best of {config['repeats']} interleaved runs"
    )
    print(
        "decode tok/s: generate = LLM.generate, (N + 1)-token run less 1-token run; bare = forward + LM head loop; "
        "1 pass = bare, the C step without its int8 residual pass"
    )
    for fmt, f in record["formats"].items():
        print()
        print(
            f"swarmkv {fmt}, aggregate decode tok/s; prefill {config['prefill_tokens']} tokens: {f['prefill_tok_s']:.0f} tok/s"
        )
        print(
            f"{'batch':>6} {'generate':>9} {'vs b1':>7} {'bare':>8} {'vs b1':>7} {'gen/bare':>9} {'1 pass':>8} {'vs b1':>7} "
            f"{'transformers':>13} {'ours/theirs':>12}"
        )
        for b, row in f["batches"].items():
            print(
                f"{b:>6} {rate(row['generate_tok_s']):>9} {times(row['vs_batch1']):>7} {rate(row['bare_tok_s']):>8} "
                f"{times(row['bare_vs_batch1']):>7} {times(row['generate_over_bare']):>9} "
                f"{rate(row['one_pass_tok_s']):>8} {times(row['one_pass_vs_batch1']):>7} "
                f"{rate(row['transformers_tok_s']):>13} {times(row['over_transformers']):>12}"
            )
    print()
    llama = record["llama_bench"]
    if "skipped" in llama:
        print(f"llama.cpp: skipped ({llama['skipped']})")
    else:
        tests = ", ".join(f"{name} {t['best_tok_s']:.1f} tok/s" for name, t in llama["tests"].items())
        print(f"llama.cpp (llama-bench, same file, {threads}, best repetition): {tests}")
        for fmt, v in llama["versus"].items():
            print(
                f"  swarmkv {fmt}: one request's decode {times(v['decode_over_tg'])} tg, prefill {times(v['prefill_over_pp'])} pp"
            )
    batched = record.get("llama_batched")
    if batched is not None:
        print(f"llama.cpp aggregate decode (llama-batched-bench, same file, {threads}, one run):")
        print(
            f"{'batch':>6} {'tok/s':>9} {'vs b1':>7} "
            + " ".join(f"{'ours/' + fmt:>12}" for fmt in batched["versus"])
        )
        for b, r in batched["decode_tok_s"].items():
            ours = " ".join(f"{times(v.get(b)):>12}" for v in batched["versus"].values())
            print(f"{b:>6} {rate(r):>9} {times(batched['vs_batch1'][b]):>7} {ours}")
    if record["targets"]:
        print()
        print("issue 26 targets")
        for t in record["targets"]:
            print(
                f"  {t['what']}: {times(t['ratio'])} (target >= {t['target']}x): {'met' if t['met'] else 'not met'}"
            )


def main(argv: list[str] | None = None) -> int:
    """Measure, print, and write the JSON if asked."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    record = measure(args)
    binary = None if args.no_llama_bench else find_llama_bench(args.llama_bench)
    if args.no_llama_bench:
        record["llama_bench"] = {"skipped": "--no-llama-bench"}
    elif binary is None:
        record["llama_bench"] = {"skipped": f"llama-bench is not on the PATH; {BUILD_HINT}"}
    else:
        model, threads = Path(record["config"]["path"]), torch.get_num_threads()
        llama = run_llama_bench(
            binary, model, threads, args.prefill_tokens, args.llama_gen_tokens, args.llama_repetitions
        )
        compare_llama(record, llama, args.prefill_tokens, args.llama_gen_tokens)
        record["llama_bench"] = llama
        batched_binary = find_batched_bench(binary)
        if batched_binary is not None:
            sizes = (args.prompt_tokens, args.decode_tokens, args.batches)
            try:
                record["llama_batched"] = run_batched_bench(batched_binary, model, threads, *sizes)
                compare_batched(record, record["llama_batched"])
            except RuntimeError as exc:  # an older build's flags: llama-bench's figures still stand
                print(f"llama-batched-bench: {exc}", file=sys.stderr)
    record["targets"] = targets(record, args.llama_gen_tokens, args.prefill_tokens)
    print_report(record)
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
