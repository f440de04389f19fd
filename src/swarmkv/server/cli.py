"""`swarmkv serve`: the OpenAI-compatible server on uvicorn, loopback unless told otherwise."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path
from typing import Any

from swarmkv.options import add_engine_arguments, add_model_arguments, engine_kwargs, model_kwargs

API_KEY_ENV = "SWARMKV_API_KEY"
DEFAULT_MAX_REQUEST_BYTES = 32 * 1024 * 1024  # here, not in body.py, so `swarmkv --help` imports no server
DEFAULT_RESPONSES_STORE_MAX = 1000  # stored Responses API responses, for `previous_response_id`


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `serve` subcommand; returns its parser, for `swarmkv.cluster` to add its flags to."""
    parser = subparsers.add_parser("serve", help="serve the OpenAI API (chat, completions, tools, /metrics)")
    add_model_arguments(parser)
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1/ routes (default: ${API_KEY_ENV}, else none)",
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the `model` clients send (default: file stem)"
    )
    parser.add_argument(
        "--log-requests",
        type=Path,
        default=None,
        metavar="FILE.jsonl",
        help="append every chat and completions request body to FILE, one JSON line each (for `swarmkv lint`)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"refuse request bodies larger than this with a 400 (default {DEFAULT_MAX_REQUEST_BYTES}, 32 MiB)",
    )
    parser.add_argument(
        "--responses-store-max",
        type=int,
        default=DEFAULT_RESPONSES_STORE_MAX,
        help="keep at most this many stored /v1/responses responses for previous_response_id, each at most "
        f"an hour (default {DEFAULT_RESPONSES_STORE_MAX}; 0 stores none)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=("critical", "error", "warning", "info", "debug")
    )
    parser.set_defaults(run=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Load the model, build the app, serve until interrupted."""
    import uvicorn

    from swarmkv.engine.llm import LLM
    from swarmkv.server.app import create_app

    prepare(args)
    llm = LLM(**model_kwargs(args), **engine_kwargs(args))
    app = create_app(llm, **app_kwargs(args))
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def prepare(args: argparse.Namespace) -> None:
    """Check the flags every way of serving shares, warn of an open listener, show swarmkv's logs."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_request_bytes < 1:
        raise ValueError(f"--max-request-bytes must be positive, got {args.max_request_bytes}")
    if args.responses_store_max < 0:
        raise ValueError(f"--responses-store-max must be at least 0, got {args.responses_store_max}")
    if not args.api_key and not _is_loopback(args.host):
        print(f"swarmkv serve: warning: listening on {args.host} without --api-key", file=sys.stderr)
    _show_swarmkv_logs(args.log_level)


def app_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`create_app`'s keyword arguments from the parsed flags (paths absolute: a replica may run elsewhere)."""
    return {
        "api_key": args.api_key or None,
        "model_name": args.served_model_name,
        "log_requests": args.log_requests.resolve() if args.log_requests is not None else None,
        "max_request_bytes": args.max_request_bytes,
        "responses_store_max": args.responses_store_max,
    }


def _show_swarmkv_logs(level: str) -> None:
    """Print swarmkv's own log lines (cache breaks at INFO, engine failures) beside uvicorn's, at `level`."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: %(message)s"))
    logger = logging.getLogger("swarmkv")
    logger.addHandler(handler)
    logger.setLevel(level.upper())
    logger.propagate = False  # an embedding program's root handler would print each line twice


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
