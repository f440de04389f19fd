"""Prefill and decode throughput of the swarmkv model, in each weight format, against transformers on the
embedded SmolLM2 GGUF (CPU, float32 activations).

Prefill: every model reads the same GGUF file, runs one prompt without a KV cache, and computes logits for
the last position only (what a prefill needs). Runs alternate between the models so that background load
hits all alike; each figure is the best of `--repeats` runs after one warm-up. glibc's heap trimming is
switched off first (see `steady_malloc`), unless `--default-malloc` is given.
Decode: one request's greedy tokens/s through the engine (swarmkv) and `generate` (transformers), prefill
excluded. Quality: each quantized format's top-1 agreement with float over a long text (this repository's
README), position by position.

    .venv/bin/python bench/forward.py [--lengths 512 2048] [--weights float int8 int4 gguf] [--repeats 3]

"gguf" holds every tensor at the file's bits (the CPU default since issue 25); "int4" is the earlier path
(Q4_1 projections in PyTorch's int4 kernel, embedding and LM head float32).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from swarmkv import LLM, SamplingParams  # noqa: E402
from swarmkv.choices import CPU_INT8_RESIDUAL_GROUPS  # noqa: E402
from swarmkv.engine import cpu_decode  # noqa: E402
from swarmkv.engine.kv_cache import KVCache  # noqa: E402
from swarmkv.engine.page_table import PageTable  # noqa: E402
from swarmkv.models.attention import CausalSelfAttention  # noqa: E402
from swarmkv.models.default import default_model_path  # noqa: E402
from swarmkv.models.loader import LoadedModel, load_model  # noqa: E402

Forward = Callable[[torch.Tensor], torch.Tensor]


def steady_malloc() -> bool:
    """Make glibc keep freed memory in its heap rather than return it to the OS; False if not glibc.

    With both models in one process, glibc's adaptive mmap and trim thresholds make whichever model's
    allocation sizes happen to straddle them refault ~350 MB of pages on every forward (about 10% of a
    512-token prefill, landing on one model or the other depending on run order). Fixed thresholds
    time the models rather than the allocator's state.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 1 << 30))


def swarmkv_prefill(loaded: LoadedModel) -> Forward:
    """One prefill through swarmkv's cache-less attention: last-position logits [1, vocab]."""

    def run(input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[0])
        hidden = loaded.model(input_ids, positions, CausalSelfAttention())
        return loaded.model.compute_logits(hidden[-1:])

    return run


def transformers_prefill(model: Any) -> Forward:
    """One prefill through transformers with SDPA and no cache: last-position logits [1, vocab]."""

    def run(input_ids: torch.Tensor) -> torch.Tensor:
        out = model(input_ids[None], use_cache=False, logits_to_keep=1)
        return out.logits[0].float()

    return run


def load_transformers() -> Any:
    """transformers' own reading of the default GGUF, dequantised to float32, with SDPA attention."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


def time_once(forward: Forward, input_ids: torch.Tensor) -> float:
    """Seconds one forward takes."""
    start = time.perf_counter()
    forward(input_ids)
    return time.perf_counter() - start


def best_seconds(
    forwards: dict[str, Forward], input_ids: torch.Tensor, repeats: int
) -> tuple[dict[str, float], float]:
    """Best time of each forward over `repeats` interleaved runs, after one warm-up each, and their max logit gap."""
    with torch.inference_mode():
        logits = [forward(input_ids) for forward in forwards.values()]  # warm-up, and a sanity check
        gap = max((a - b).abs().max().item() for a in logits for b in logits)
        times: dict[str, list[float]] = {name: [] for name in forwards}
        for _ in range(repeats):
            for name, forward in forwards.items():
                times[name].append(time_once(forward, input_ids))
    return {name: min(samples) for name, samples in times.items()}, gap


def swarmkv_decode_tok_s(loaded: LoadedModel, prompt: list[int], num_tokens: int) -> float:
    """Greedy decode tokens/s of one request through the engine, its prefill step excluded."""
    llm = LLM(loaded=loaded, kv_cache_memory="64MiB")
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens + 1, ignore_eos=True)
    engine.add_request("decode", prompt, params)
    engine.step()  # the prefill, and the first token
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return num_tokens / (time.perf_counter() - start)


def transformers_decode_tok_s(model: Any, prompt: list[int], num_tokens: int) -> float:
    """Greedy decode tokens/s of `generate` with its KV cache: the time of n + 1 tokens less that of 1."""
    ids = torch.tensor([prompt])

    def generate(n: int) -> float:
        start = time.perf_counter()
        model.generate(
            ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids)
        )
        return time.perf_counter() - start

    with torch.inference_mode():
        generate(2)  # warm-up
        return num_tokens / (generate(num_tokens + 1) - generate(1))


def top1_agreement(loaded: LoadedModel, reference: LoadedModel, ids: list[int]) -> float:
    """The share of positions of `ids` where both models' most likely next token is the same."""
    with torch.inference_mode():
        picks = [swarmkv_all_logits(m, ids).argmax(-1) for m in (loaded, reference)]
    return float((picks[0] == picks[1]).float().mean())


def decode_step_logits(
    loaded: LoadedModel,
    ids: list[int],
    int8_activations: bool,
    residual_groups: int = CPU_INT8_RESIDUAL_GROUPS,
) -> torch.Tensor:
    """Logits at every position of one sequence [T, vocab], fed token by token through the C decode step
    (engine/cpu_decode.py) over its own KV pages: what decoding computes, teacher-forced."""
    page_size = 16
    num_pages = -(-len(ids) // page_size)
    kv = KVCache(loaded.config, num_pages, page_size, torch.float32, torch.device("cpu"))
    table = PageTable(1, num_pages, page_size, torch.device("cpu"))
    table.append("text", list(range(num_pages)))
    step = cpu_decode.describe(loaded.model, kv, table, int8_activations, residual_groups)
    one = torch.zeros(1, dtype=torch.int64)
    rows = [step.step(torch.tensor([t]), one, torch.tensor([i]), [1], [0]) for i, t in enumerate(ids)]
    return torch.cat(rows)


def swarmkv_all_logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence [T, vocab]."""
    hidden = loaded.model(torch.tensor(ids), torch.arange(len(ids)), CausalSelfAttention())
    return loaded.model.compute_logits(hidden)


def main() -> None:
    """Measure and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[512, 2048], help="prompt lengths in tokens"
    )
    parser.add_argument(
        "--weights",
        nargs="+",
        default=["float", "int8", "int4", "gguf"],
        choices=["float", "int8", "int4", "gguf"],
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per model and length")
    parser.add_argument("--decode-tokens", type=int, default=48, help="tokens timed per decode run")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--default-malloc", action="store_true", help="leave glibc's adaptive heap trimming on"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    malloc = "glibc defaults" if args.default_malloc or not steady_malloc() else "heap trimming off"

    models = {fmt: load_model(None, dtype="float32", weights=fmt) for fmt in args.weights}
    hf = load_transformers()
    forwards = {f"swarmkv {fmt}": swarmkv_prefill(m) for fmt, m in models.items()}
    forwards["transformers"] = transformers_prefill(hf)
    generator = torch.Generator().manual_seed(0)
    print(
        f"SmolLM2-135M-Instruct (Q4_1 GGUF), float32 activations, CPU, {torch.get_num_threads()} threads, "
        f"malloc: {malloc}"
    )
    print(f"best of {args.repeats} interleaved runs after one warm-up; logits for the last position only")
    print()
    names = list(forwards)
    print(f"{'tokens':>7} " + " ".join(f"{n + ' tok/s':>22}" for n in names) + "   vs transformers")
    for num_tokens in args.lengths:
        input_ids = torch.randint(0, hf.config.vocab_size, (num_tokens,), generator=generator)
        seconds, _ = best_seconds(forwards, input_ids, args.repeats)
        rates = {n: num_tokens / seconds[n] for n in names}
        ratios = " ".join(f"{rates[n] / rates['transformers']:.2f}x" for n in names[:-1])
        print(f"{num_tokens:>7} " + " ".join(f"{rates[n]:>22.0f}" for n in names) + f"   {ratios}")

    prompt = list(range(100, 164))
    print()
    print(f"decode, one request, {args.decode_tokens} greedy tokens after a 64-token prompt")
    theirs = transformers_decode_tok_s(hf, prompt, args.decode_tokens)
    floats = None
    for fmt, loaded in models.items():
        ours = swarmkv_decode_tok_s(loaded, prompt, args.decode_tokens)
        floats = floats or (ours if fmt == "float" else None)
        versus_float = f", {ours / floats:.2f}x float" if floats else ""
        print(f"  swarmkv {fmt:>5}: {ours:6.1f} tok/s ({ours / theirs:.2f}x transformers{versus_float})")
    print(f"  transformers: {theirs:6.1f} tok/s")

    if "float" in models:
        text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
        ids = models["float"].tokenizer.encode(text)[:1024]
        print()
        print(f"top-1 agreement with float over {len(ids)} tokens of README.md")
        for fmt, loaded in models.items():
            if fmt != "float":
                print(f"  {fmt}: {top1_agreement(loaded, models['float'], ids):.1%}")
        gguf = models.get("gguf")
        if (
            gguf is not None
            and cpu_decode.why_not(
                gguf.model, KVCache(gguf.config, 1, 16, torch.float32, gguf.device), gguf.device
            )
            is None
        ):
            with torch.inference_mode():
                reference = swarmkv_all_logits(models["float"], ids).argmax(-1)
                for int8, groups in ((True, CPU_INT8_RESIDUAL_GROUPS), (True, 0), (False, 0)):
                    picks = decode_step_logits(gguf, ids, int8, groups).argmax(-1)
                    agreement = float((picks == reference).float().mean())
                    kind = f"int8 activations, residual pass over {groups} groups" if int8 else "float32"
                    print(f"  gguf, the C decode step, {kind}: {agreement:.1%}")
                # what cpu_prefill_bf16 computes for a prefill chunk (the runner's autocast; head in float32)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    hidden = gguf.model(torch.tensor(ids), torch.arange(len(ids)), CausalSelfAttention())
                picks = gguf.model.compute_logits(hidden.float()).argmax(-1)
                agreement = float((picks == reference).float().mean())
                print(f"  gguf, a prefill under bfloat16 autocast (cpu_prefill_bf16): {agreement:.1%}")


if __name__ == "__main__":
    main()
