"""`swarmkv generate`: answer one prompt on the engine, as text or as one JSON object."""

from __future__ import annotations

import argparse
import json

from swarmkv.core.sampling_params import SamplingParams
from swarmkv.engine.llm import LLM
from swarmkv.options import add_engine_arguments, add_model_arguments, engine_kwargs, model_kwargs


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `generate` subcommand."""
    parser = subparsers.add_parser("generate", help="generate a reply to one prompt")
    add_model_arguments(parser)
    add_engine_arguments(parser)
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
    llm = LLM(**model_kwargs(args), **engine_kwargs(args))
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
