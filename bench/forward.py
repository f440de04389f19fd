"""Prefill throughput of the swarmkv model against transformers on the embedded SmolLM2 GGUF (CPU, float32).

Both models read the same GGUF file, run one prompt without a KV cache, and compute logits for the last
position only (what a prefill needs). Runs alternate between the two models so that background load hits
both alike; each figure is the best of `--repeats` runs after one warm-up. glibc's heap trimming is
switched off first (see `steady_malloc`), unless `--default-malloc` is given.

    .venv/bin/python bench/forward.py [--lengths 512 2048] [--repeats 3] [--threads N] [--default-malloc]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

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


def main() -> None:
    """Measure and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[512, 2048], help="prompt lengths in tokens"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per model and length")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument(
        "--default-malloc", action="store_true", help="leave glibc's adaptive heap trimming on"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    malloc = "glibc defaults" if args.default_malloc or not steady_malloc() else "heap trimming off"

    loaded = load_model(None, dtype="float32")
    forwards = {"swarmkv": swarmkv_prefill(loaded), "transformers": transformers_prefill(load_transformers())}
    generator = torch.Generator().manual_seed(0)
    print(
        f"SmolLM2-135M-Instruct (Q4_1 GGUF dequantised), float32, CPU, {torch.get_num_threads()} threads, "
        f"malloc: {malloc}"
    )
    print(f"best of {args.repeats} interleaved runs after one warm-up; logits for the last position only")
    print()
    print(
        f"{'tokens':>7} {'swarmkv tok/s':>14} {'transformers tok/s':>19} {'ratio':>6} {'max |logit diff|':>17}"
    )
    for num_tokens in args.lengths:
        input_ids = torch.randint(0, loaded.config.vocab_size, (num_tokens,), generator=generator)
        seconds, gap = best_seconds(forwards, input_ids, args.repeats)
        ours, theirs = num_tokens / seconds["swarmkv"], num_tokens / seconds["transformers"]
        print(f"{num_tokens:>7} {ours:>14.0f} {theirs:>19.0f} {ours / theirs:>5.2f}x {gap:>17.2e}")


if __name__ == "__main__":
    main()
