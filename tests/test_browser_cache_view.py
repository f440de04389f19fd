"""The live cache page in a real browser: headless Chromium loads /cache, runs its script, and draws the tree.

A tiny Qwen3 server takes a small swarm of chats sharing a long system prompt; Chromium's `--dump-dom`
returns the page after its script fetched /v1/cache/tree and drew it, and the trunk it drew must hold
exactly the shared head: the rendered prompts' common prefix, in the full pages the tree shares. A
screenshot is kept under pytest's tmp dir (and copied to docs/cache-view.png, the README's, with
SWARMKV_UPDATE_DOCS=1).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest

from swarmkv.engine.llm import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext
from tiny_models import make_tiny_checkpoint

BLOCK = 16

pytestmark = [pytest.mark.browser, pytest.mark.e2e]
DOCS_SCREENSHOT = Path(__file__).resolve().parent.parent / "docs" / "cache-view.png"
SYSTEM = (
    "You are one agent of a coding swarm working on a large Python service. Read the task, inspect the "
    "files you need, make the smallest change that solves it, run the tests, and answer with a two-line "
    "summary of what you changed. Never touch files outside the task. Prefer clear names to comments."
)
TASKS = (
    "Fix the flaky retry test.",
    "Rename the config loader.",
    "Add type hints to the cache module.",
    "Update the changelog for the release.",
    "Remove the unused helper in utils.",
)
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--hide-scrollbars",
    "--virtual-time-budget=5000",
)


def chromium() -> str:
    """The Chromium binary, or a skip that says how to install it."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.skip(
            "headless Chromium is not installed: `apt-get install chromium` (make install-test tries)"
        )
    return binary


class _Nodes(HTMLParser):
    """The attributes of every drawn node (`<g data-tokens=...>`) in a dumped DOM."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if "data-tokens" in found:
            self.nodes.append(found)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ServerContext]]:
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("browser") / "qwen3", "qwen3")
    llm = LLM(str(folder), kv_cache_memory="8MiB", block_size=BLOCK, max_model_len=512)
    app = create_app(llm, ServerConfig(served_model_name="tiny"))
    with BackgroundServer(app) as server:
        yield server.url, app.state.ctx


def _messages(task: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]


def _prompts(ctx: ServerContext) -> list[list[int]]:
    """The token ids the server runs for each chat."""
    texts = [ctx.tokenizer.apply_chat_template(_messages(task)) for task in TASKS]
    return [ctx.tokenizer.encode(text, add_special_tokens=False) for text in texts]


def _shared_head_tokens(ctx: ServerContext) -> int:
    """The tree shares full pages only, so the trunk is the prompts' common prefix floored to a page."""
    return len(os.path.commonprefix(_prompts(ctx))) // BLOCK * BLOCK


def _run_chromium(profile: Path, *args: str) -> str:
    command = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_page_draws_the_shared_head_as_the_trunk(
    served: tuple[str, ServerContext], tmp_path: Path
) -> None:
    chromium()  # skip before the swarm runs when there is no browser
    url, ctx = served
    with httpx.Client(base_url=url, timeout=60) as http:
        for i, task in enumerate(TASKS):
            body = {
                "messages": _messages(task),
                "max_tokens": 6,
                "temperature": 0,
                "session_id": f"agent-{i}",
            }
            assert http.post("/v1/chat/completions", json=body).status_code == 200
        # A pin on the head's whole pages holds them (and, page-aligned, leaves no partial leaf behind):
        # the trunk is drawn held and pinned.
        pin = http.post(
            "/v1/cache/pin", json={"prompt_token_ids": _prompts(ctx)[0][: _shared_head_tokens(ctx)]}
        )
        assert pin.status_code == 200, pin.text

    dom = _run_chromium(tmp_path / "profile", "--dump-dom", f"{url}/cache")
    parser = _Nodes()
    parser.feed(dom)
    trunks = [n for n in parser.nodes if n.get("data-role") == "trunk"]
    assert len(trunks) == 1, dom[-3000:]
    head = _shared_head_tokens(ctx)
    assert head >= 4 * BLOCK
    assert trunks[0]["data-tokens"] == str(head)
    # Every chat finished; the pin is the one holder left.
    assert trunks[0]["data-holders"] == "1" and trunks[0]["data-pinned"] == "true"
    tails = [n for n in parser.nodes if n is not trunks[0]]
    assert len(tails) == len(TASKS) and all(n["data-holders"] == "0" for n in tails)
    assert "hit rate" in dom

    shot = tmp_path / "cache-view.png"
    _run_chromium(tmp_path / "profile", f"--screenshot={shot}", "--window-size=1200,800", f"{url}/cache")
    assert shot.stat().st_size > 1000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("SWARMKV_UPDATE_DOCS") == "1":  # refresh the README's screenshot on request only
        shutil.copyfile(shot, DOCS_SCREENSHOT)
