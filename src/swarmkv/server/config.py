"""ServerConfig: the one source of the server's settings; `create_app` takes it and `swarmkv serve`'s flags derive from it.

Each field carries its help text (argparse fills `%(default)s`), as `EngineConfig`'s do; `cli.py` turns the
fields into flags, so a default written here is the default everywhere. Imports nothing of the server.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from swarmkv.choices import HostedToolsPolicy, MaxTokensPolicy, PromptLayout, ToolCallGrammar

API_KEY_ENV = "SWARMKV_API_KEY"
LogLevel = Literal["critical", "error", "warning", "info", "debug"]


def _opt(default: Any, help: str, **flag: Any) -> Any:
    """A field with its help text; `flag` holds extra argparse settings (metavar, env)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True)
class ServerConfig:
    """How one server listens, authenticates, names its model and bounds what it keeps."""

    host: str = _opt("127.0.0.1", "address to bind (default loopback only)")
    port: int = _opt(8000, "port to listen on (default %(default)s; 0: any free port)")
    api_key: str | None = _opt(
        None,
        f"require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1/ routes (default: ${API_KEY_ENV}, "
        "else none)",
        env=API_KEY_ENV,
    )
    served_model_name: str | None = _opt(
        None,
        "restrict the `model` names clients may send to these: a name, or several separated by commas "
        "(aliases; the first names replies), where '*' answers any name (default: any name is answered, "
        "and a reply carries the name it was asked for; the model's file stem or folder name is listed)",
        metavar="NAME[,NAME...]",
    )
    log_requests: Path | None = _opt(
        None,
        "append every chat and completions request body to FILE, one JSON line each (for `swarmkv lint`)",
        metavar="FILE.jsonl",
    )
    max_request_bytes: int = _opt(
        32 * 1024 * 1024, "refuse request bodies larger than this with a 400 (default %(default)s, 32 MiB)"
    )
    responses_store_max: int = _opt(
        1000,
        "keep at most this many stored /v1/responses responses for previous_response_id, each at most "
        "an hour (default %(default)s; 0 stores none); with --api-keys each tenant keeps its equal share",
    )
    log_level: LogLevel = _opt("info", "swarmkv's and uvicorn's log level (default %(default)s)")
    hosted_tools: HostedToolsPolicy = _opt(
        "drop",
        "what a /v1/responses tool the provider would run (web_search, file_search, ...) gets: drop (left "
        "out of the prompt, named in the response's `swarmkv.dropped_tools`) or refuse (a 400) "
        "(default %(default)s)",
    )
    max_tokens_policy: MaxTokensPolicy = _opt(
        "clamp",
        "what a max_tokens (max_output_tokens, max_completion_tokens) above what the context leaves after "
        "the prompt gets: clamp (to that room; the reply ends in 'length' if it gets there) or refuse "
        "(a 400) (default %(default)s)",
    )
    tool_call_grammar: ToolCallGrammar = _opt(
        "always",
        "which tool calls follow their tool's schema under a grammar: always (any call the model writes "
        "when tools are offered) or strict (only strict tools', and calls tool_choice forces, as vLLM does) "
        "(default %(default)s)",
    )
    prompt_layout: PromptLayout = _opt(
        "auto",
        "where a chat prompt's tool block goes: template (the chat template's order), tools-first (the tool "
        "block the template renders moved before the system text, in the same system turn, so agents whose "
        "system texts differ still share the tools' KV; the template's order where the block cannot be found "
        "exactly) or auto (tools-first on /v1/messages, Anthropic's cache order; template elsewhere) "
        "(default %(default)s)",
    )
    # Last, so that positional construction of the fields above holds.
    api_keys: Path | None = _opt(
        None,
        "serve several tenants: FILE holds one 'KEY TENANT' line per key ('#' comments; a third word 'admin' "
        "lets that key's cache view show every tenant); a tenant's caches, sessions, pins and stored "
        "responses are its own (instead of --api-key)",
        metavar="FILE",
    )

    allowed_hosts: str | None = _opt(
        None,
        "host names the Host header may carry, besides IP addresses, localhost and the --host name, which are "
        "always answered (any port); another name gets a 400, so a DNS-rebinding web page cannot reach the "
        "server. Separate names by commas; '*' answers any (default: none)",
        metavar="HOST[,HOST...]",
    )
    cors_origins: str | None = _opt(
        None,
        "web origins (scheme://host[:port], separated by commas, or '*' for any) whose pages may call this "
        "server from a browser: their preflights are answered and their responses carry CORS headers "
        "(default: none, no CORS headers at all)",
        metavar="ORIGIN[,ORIGIN...]",
    )
    metrics_public: bool = _opt(
        False, "answer /metrics without the API key when --api-key is set (default: /metrics needs the key)"
    )
    # HTTP hygiene (`http/protocol.py`): no client holds a socket by sending slowly, or a header without end.
    header_timeout_s: float = _opt(
        10.0,
        "answer a 408 and close a connection whose request line and headers have not all arrived this many "
        "seconds after it opened (or after the request's first byte, on a kept-alive one) (default %(default)s)",
    )
    body_timeout_s: float = _opt(
        30.0,
        "answer a 408 and close a connection whose request body has not all arrived this many seconds after "
        "its headers (default %(default)s)",
    )
    max_header_bytes: int = _opt(
        64 * 1024,
        "answer a 431 to a request whose request line and headers exceed this many bytes (default %(default)s)",
    )
    max_headers: int = _opt(
        100, "answer a 431 to a request with more header fields than this (default %(default)s)"
    )
    keep_alive_timeout_s: float = _opt(
        5.0, "close a kept-alive connection idle this many seconds between requests (default %(default)s)"
    )
    max_requests_per_connection: int = _opt(
        1000,
        "answer at most this many requests on one kept-alive connection; the last says `connection: close` "
        "(default %(default)s)",
    )
    max_step_s: float = _opt(
        1.0,
        "cap each engine step's tokens to what the prefill speed measured from recent steps computes in this "
        "many seconds (at least a page's), so that the request of a client that went away is freed within "
        "about this long: aborts apply between steps, and a 2,048-token prefill step takes seconds on a CPU; "
        "a GPU's steps are shorter, so it seldom binds there (default %(default)s; 0: the token budget alone)",
    )
    log_cache_break_text: bool = _opt(
        False,
        "with each cache break's log line (tenant, session, offset, cause), write up to 160 characters of the "
        "prompt text where it diverged (default: the text is in no log)",
    )
    log_requests_max_bytes: int = _opt(
        256 * 1024 * 1024,
        "rotate the --log-requests file past this size: FILE becomes FILE.1, FILE.1 FILE.2, and 3 files are "
        "kept (default %(default)s, 256 MiB)",
    )

    @property
    def allowed_host_names(self) -> frozenset[str] | None:
        """The Host names answered besides IP addresses and localhost, lower case; None: any name."""
        names = (*_comma_list(self.allowed_hosts), self.host)
        return None if "*" in names else frozenset(name.strip("[]").rstrip(".").lower() for name in names)

    @property
    def cors_origin_list(self) -> tuple[str, ...]:
        """The origins `--cors-origins` lists, lower case ('*' among them when given; empty: CORS is off)."""
        return tuple(origin.lower() for origin in _comma_list(self.cors_origins))

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names `--served-model-name` lists, '*' among them when given (empty: the default name only)."""
        if self.served_model_name is None:
            return ()
        return tuple(name.strip() for name in self.served_model_name.split(","))

    def __post_init__(self) -> None:
        if any(not name for name in self.model_names):
            raise ValueError(f"--served-model-name has an empty name: {self.served_model_name!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in 0..65535, got {self.port}")
        if self.max_request_bytes < 1:
            raise ValueError(f"--max-request-bytes must be positive, got {self.max_request_bytes}")
        if self.log_requests_max_bytes < 1:
            raise ValueError(f"--log-requests-max-bytes must be positive, got {self.log_requests_max_bytes}")
        for name in ("header_timeout_s", "body_timeout_s", "max_header_bytes", "max_headers",
                     "keep_alive_timeout_s", "max_requests_per_connection"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if not self.max_step_s >= 0:
            raise ValueError(f"--max-step-s must be at least 0, got {self.max_step_s}")
        if self.responses_store_max < 0:
            raise ValueError(f"--responses-store-max must be at least 0, got {self.responses_store_max}")
        for name in _comma_list(self.allowed_hosts):
            with_port = name.count(":") == 1 or "]:" in name  # IPv6 addresses have several colons
            if not name or with_port or any(c in name for c in "/ "):
                raise ValueError(f"--allowed-hosts takes host names without a scheme or port, got {name!r}")
        for origin in _comma_list(self.cors_origins):
            if origin != "*" and not _ORIGIN.fullmatch(origin):
                raise ValueError(
                    f"--cors-origins takes origins like 'https://app.example' or 'http://localhost:3000' (no "
                    f"path, no trailing '/'), or '*', got {origin!r}"
                )


# scheme://host[:port], as a browser's Origin header spells a page's origin.
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+", re.IGNORECASE)


def _comma_list(value: str | None) -> tuple[str, ...]:
    """The stripped items of a comma-separated flag value (empty for None)."""
    return () if value is None else tuple(item.strip() for item in value.split(","))
