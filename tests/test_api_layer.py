"""The protocol layer: it imports no web framework, the server, lint and the router render through its one
renderer, and `swarmkv serve`'s flags are ServerConfig's fields."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from swarmkv.api.chat_request import parse_chat_request
from swarmkv.api.paths import CHAT_ROUTE, COMPLETIONS_ROUTE
from swarmkv.api.render import render_chat, render_completion
from swarmkv.cluster.route_key import RouteKeyer
from swarmkv.lint.log_file import LoggedRequest
from swarmkv.lint.render import Renderer
from swarmkv.server.cli import register, server_config
from swarmkv.server.config import API_KEY_ENV, ServerConfig
from swarmkv.tokenizer import Tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def test_the_protocol_layer_imports_no_web_framework() -> None:
    code = (
        "import importlib, pkgutil, sys, swarmkv.api\n"
        "for m in pkgutil.iter_modules(swarmkv.api.__path__): importlib.import_module('swarmkv.api.' + m.name)\n"
        "loaded = sorted(n for n in sys.modules if n.split('.')[0] in ('starlette', 'uvicorn') or "
        "n.startswith('swarmkv.server'))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    "tool_choice", ["none", "auto", "required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_lint_and_the_router_render_chats_as_the_server_does(qwen: Tokenizer, tool_choice: Any) -> None:
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": TOOLS,
        "tool_choice": tool_choice,
    }
    rendered = render_chat(qwen, parse_chat_request(body))
    assert ("get_weather" in rendered.text.split("<|im_start|>user")[0]) == (tool_choice != "none")
    linted = Renderer(qwen).render(LoggedRequest(0, 1, CHAT_ROUTE, body)).prompt
    routed = RouteKeyer(qwen).route("POST", CHAT_ROUTE, {}, json.dumps(body).encode()).key
    assert linted.token_ids == rendered.token_ids == list(routed.tokens)


def test_lint_and_the_router_encode_completions_as_the_server_does(smol: Tokenizer) -> None:
    for prompt in ("Once upon a time", [1, 2, 3]):
        body = {"prompt": prompt}
        expected = render_completion(smol, prompt)
        linted = Renderer(smol).render(LoggedRequest(0, 1, COMPLETIONS_ROUTE, body)).prompt
        routed = RouteKeyer(smol).route("POST", COMPLETIONS_ROUTE, {}, json.dumps(body).encode()).key
        assert linted.token_ids == expected == list(routed.tokens)


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_serve_flags_are_server_config_fields(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert server_config(_serve_args()) == ServerConfig()
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert server_config(_serve_args()) == replace(ServerConfig(), api_key="from-env")
    monkeypatch.chdir(tmp_path)
    args = _serve_args(
        "--host", "0.0.0.0", "--port", "0", "--api-key", "k", "--served-model-name", "m",
        "--log-requests", "log.jsonl", "--max-request-bytes", "5", "--responses-store-max", "0",
        "--log-level", "debug",
    )  # fmt: skip
    expected = ServerConfig("0.0.0.0", 0, "k", "m", tmp_path / "log.jsonl", 5, 0, "debug")
    assert server_config(args) == expected
    for flag, value in (("--port", "65536"), ("--max-request-bytes", "0"), ("--responses-store-max", "-1")):
        with pytest.raises(ValueError, match=flag):
            server_config(_serve_args(flag, value))
