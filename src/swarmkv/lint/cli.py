"""`swarmkv lint FILE.jsonl`: where a request log's prompts stop sharing their head, why, and what fixing
it would save in cache hits and KV bytes."""

from __future__ import annotations

import argparse
import json
import sys

from swarmkv.choices import PROMPT_LAYOUTS
from swarmkv.core.config import EngineConfig
from swarmkv.lint.log_file import LintInputError, read_log_file, write_log
from swarmkv.units import parse_size

EXIT_UNDER_TARGET = 1


def _rate(value: str) -> float:
    rate = float(value)
    if not 0 <= rate <= 1:
        raise argparse.ArgumentTypeError(f"must be a hit rate between 0 and 1, got {value}")
    return rate


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `lint` subcommand."""
    parser = subparsers.add_parser(
        "lint", help="find what breaks prefix sharing in a request log (swarmkv serve --log-requests)"
    )
    parser.add_argument("file", metavar="FILE.jsonl", help="request log: one JSON request a line")
    parser.add_argument(
        "--model",
        metavar="PATH",
        default=None,
        help="HF directory or GGUF file (default: the embedded SmolLM2)",
    )
    parser.add_argument(
        "--page-size",
        metavar="TOKENS",
        type=int,
        default=EngineConfig.block_size,
        help=f"tokens per KV page, the engine's --block-size (default {EngineConfig.block_size})",
    )
    parser.add_argument(
        "--kv-cache-memory",
        metavar="SIZE",
        type=parse_size,
        default=None,
        help="KV pool to replay into, in float16 pages, e.g. 2GiB (default: unlimited, nothing is evicted)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    parser.add_argument(
        "--fail-under",
        metavar="RATE",
        type=_rate,
        default=None,
        help="exit 1 when the hit rate is under this (0..1)",
    )
    parser.add_argument("--fix", metavar="OUT.jsonl", default=None, help="write the rewritten log here")
    parser.add_argument("--strict", action="store_true", help="stop at a malformed line (exit 2)")
    parser.add_argument(
        "--prompt-layout",
        choices=PROMPT_LAYOUTS,
        default="auto",
        help="the server's --prompt-layout, which lint renders each request in: auto is tools-first on every "
        "API, as the server's (default %(default)s)",
    )
    parser.set_defaults(run=run)


def _first_reasons(reasons: list[str], shown: int = 3) -> str:
    """The first few reasons, for an error that stops the lint: ": line 1: ...; line 2: ... (and 6 more)"."""
    if not reasons:
        return ""
    more = f" (and {len(reasons) - shown} more)" if len(reasons) > shown else ""
    return ": " + "; ".join(reasons[:shown]) + more


def run(args: argparse.Namespace) -> int:
    """Lint the log; 0 when clean, 1 under --fail-under, errors (exit 2) raised to the caller."""
    from swarmkv.lint.model import load_lint_model
    from swarmkv.lint.report import print_report, to_json
    from swarmkv.lint.run import lint_log

    if args.page_size <= 0:
        raise ValueError(f"--page-size must be positive, got {args.page_size}")
    log = read_log_file(args.file, strict=args.strict)
    requests, problems = log.requests, log.problems
    if not requests:
        refusals = [f"line {r.line}: {r.status} {r.error}" for r in log.refused]
        raise LintInputError(
            f"{args.file} holds no requests ({len(problems)} malformed lines, {len(log.refused)} refused)"
            + _first_reasons(refusals)
        )
    for request in requests:
        note = request.capped_note()
        if note is not None:
            print(f"swarmkv lint: warning: {args.file}:{request.line}: {note}", file=sys.stderr)
    model = load_lint_model(args.model)
    page_bytes = model.page_bytes(args.page_size)
    result = lint_log(
        requests,
        model.tokenizer,
        args.page_size,
        page_bytes,
        args.kv_cache_memory,
        problems,
        max_model_len=model.config.max_position_embeddings,
        prompt_layout=args.prompt_layout,
        refused=log.refused,
    )
    if not result.requests:
        reasons = [f"line {p.line}: {p.message}" for p in result.skipped]
        raise LintInputError(
            f"none of the {len(requests)} requests in {args.file} could be rendered" + _first_reasons(reasons)
        )
    if args.fix is not None:
        write_log(args.fix, result.fixed)
    if args.json:
        for problem in result.skipped:  # the report lists them; JSON readers may not look
            print(f"swarmkv lint: warning: {args.file}:{problem.line}: {problem.message}", file=sys.stderr)
        print(json.dumps(to_json(result), ensure_ascii=False))
    else:
        families = f"{len(result.families)} famil{'y' if len(result.families) == 1 else 'ies'}"
        title = (
            f"swarmkv lint {args.file}: {len(result.requests)} requests, {len(result.sessions)} sessions, "
            f"{families}, {model.name}, pages of {args.page_size} tokens ({page_bytes:,} B)"
        )
        print_report(result, title)
    if args.fail_under is not None and result.hit_rate < args.fail_under:
        return EXIT_UNDER_TARGET
    return 0
