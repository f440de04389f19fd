"""`swarmkv generate`: answer one prompt on the engine, as text or as one JSON object."""

from __future__ import annotations

import argparse
import json

from swarmkv.engine.llm import LLM
from swarmkv.engine.sampling_params import SamplingParams


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and engine options shared by every command that runs a model."""
    parser.add_argument(
        "--model", default=None, help="HF directory or GGUF file (default: embedded SmolLM2-135M)"
    )
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="KV pool size, e.g. 512MiB, 2GiB")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV page")


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `generate` subcommand."""
    parser = subparsers.add_parser("generate", help="generate a reply to one prompt")
    add_model_arguments(parser)
    parser.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--temperature", type=float, default=None, help="sample at this temperature (default greedy)"
    )
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Load the model, generate, print."""
    llm = LLM(
        model=args.model,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        dtype=args.dtype,
        device=args.device,
    )
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature if args.temperature is not None else 0.0,
        top_p=args.top_p,
        seed=args.seed,
    )
    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    (out,) = llm.generate([prompt], params)
    if out.error is not None:
        raise ValueError(out.error)
    if args.json:
        record = {
            "text": out.text,
            "token_ids": out.token_ids,
            "prompt_token_ids": out.prompt_token_ids,
            "finish_reason": out.finish_reason,
        }
        print(json.dumps(record))
    else:
        print(out.text)
    return 0
