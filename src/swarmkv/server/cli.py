"""`swarmkv serve`: the OpenAI-compatible server on uvicorn, loopback unless told otherwise.

The server's flags are derived from `ServerConfig`'s fields (their defaults and help), after the model's and
the engine's, which `swarmkv.options` derives from `ModelOptions` and `EngineConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import ipaddress
import logging
import os
import sys
import typing
from pathlib import Path
from typing import Any

from swarmkv.options import add_engine_arguments, add_model_arguments, engine_kwargs, model_kwargs
from swarmkv.server.config import ServerConfig
from swarmkv.server.tenants import TenantKeys

if typing.TYPE_CHECKING:
    from swarmkv.server.context import ServerContext


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the `serve` subcommand; returns its parser, for `swarmkv.cluster` to add its flags to."""
    parser = subparsers.add_parser("serve", help="serve the OpenAI API (chat, completions, tools, /metrics)")
    add_model_arguments(parser)
    add_engine_arguments(parser)
    add_server_arguments(parser)
    parser.set_defaults(run=run)
    return parser


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerConfig field; a field naming an environment variable takes its default from there."""
    hints = typing.get_type_hints(ServerConfig)
    for f in dataclasses.fields(ServerConfig):
        env = f.metadata.get("env")
        options: dict[str, Any] = {
            "default": os.environ.get(env, f.default) if env else f.default,
            "help": f.metadata["help"],
        }
        if "metavar" in f.metadata:
            options["metavar"] = f.metadata["metavar"]
        kind = hints[f.name]
        if kind is bool:
            options["action"] = "store_true"
        elif typing.get_origin(kind) is typing.Literal:
            options["choices"] = typing.get_args(kind)
        elif kind is int:
            options["type"] = int
        elif kind is float:
            options["type"] = float
        elif Path in typing.get_args(kind):
            options["type"] = Path
        parser.add_argument("--" + f.name.replace("_", "-"), **options)


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The ServerConfig of parsed flags (paths absolute: a replica may run elsewhere); a ValueError if invalid."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerConfig)}
    values["api_key"] = values["api_key"] or None
    if values["log_requests"] is not None:
        values["log_requests"] = values["log_requests"].resolve()
    if values["api_keys"] is not None:
        values["api_keys"] = values["api_keys"].resolve()
    return ServerConfig(**values)


def run(args: argparse.Namespace) -> int:
    """Load the model, build the app, serve until interrupted."""
    import uvicorn

    from swarmkv.engine.llm import LLM
    from swarmkv.server.app import create_app
    from swarmkv.server.http.protocol import uvicorn_options

    config = prepare(args)
    llm = LLM(**model_kwargs(args), **engine_kwargs(args))
    context_warning = short_context_warning(llm.engine.max_model_len)
    if context_warning is not None:
        print(f"swarmkv serve: warning: {context_warning}", file=sys.stderr)
    app = create_app(llm, config)
    print(f"swarmkv serve: {model_names_line(app.state.ctx)}", file=sys.stderr)
    # What is loaded by now (torch, the model) lives as long as the server: kept out of the collector's
    # reach, a full collection (a body of thousands of messages sets one off) takes milliseconds, not 0.5 s.
    gc.collect()
    gc.freeze()
    # The server's own HTTP protocol: header and body deadlines and bounds uvicorn lacks (http/protocol.py).
    http = uvicorn_options(config)
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level, **http)
    return 0


def model_names_line(ctx: ServerContext) -> str:
    """What `model` names the server answers, said at start."""
    if ctx.answers_any_name:
        return (
            f"answering any model name with {ctx.model_name!r}, and naming replies with the name asked for "
            "(--served-model-name restricts the names)"
        )
    return f"answering the model names {', '.join(map(repr, ctx.listed_model_names))} (--served-model-name)"


def prepare(args: argparse.Namespace) -> ServerConfig:
    """Check the flags every way of serving shares, warn of an open listener, show swarmkv's logs."""
    config = server_config(args)
    TenantKeys.of(config.api_key, config.api_keys)  # a bad key file stops here, before the model loads
    for warning in config_warnings(config):
        print(f"swarmkv serve: warning: {warning}", file=sys.stderr)
    _show_swarmkv_logs(config.log_level)
    return config


def config_warnings(config: ServerConfig) -> list[str]:
    """What in `config` lets others use the server: no key off loopback, or browser checks turned off."""
    if config.api_key or config.api_keys:
        return []
    warnings = []
    if not _is_loopback(config.host):
        warnings.append(
            f"listening on {config.host} without --api-key: anyone who reaches this port can run requests, "
            "read /v1/cache/tree and stored responses, and delete them (set --api-key or $SWARMKV_API_KEY)"
        )
    if "*" in config.cors_origin_list:
        warnings.append(
            "--cors-origins '*' without --api-key: any web page a browser here opens can use this server"
        )
    if config.allowed_host_names is None:
        warnings.append(
            "--allowed-hosts '*' without --api-key: a web page that rebinds its DNS name to this address can "
            "use this server"
        )
    return warnings


# Coding harnesses' first requests (system prompt and tools) are 9K to 27K tokens; a context under this
# refuses some of them outright.
HARNESS_CONTEXT_TOKENS = 32_768


def short_context_warning(max_model_len: int) -> str | None:
    """Why a model with a short context will refuse coding harnesses' first requests; None when it will not."""
    if max_model_len >= HARNESS_CONTEXT_TOKENS:
        return None
    return (
        f"this model's context is {max_model_len} tokens: coding harnesses (Claude Code, Codex, Qwen Code) send "
        f"first requests of 9K to 27K tokens, which are refused as longer than the context; serve a model "
        f"with at least {HARNESS_CONTEXT_TOKENS} tokens of context (--model) for them"
    )


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
