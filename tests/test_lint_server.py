"""The lint's replay against a live server: the same requests, sent in order to `swarmkv serve` (in-process,
the real default model, max_tokens 1), are cached to the token as the replay of the server's own request log
says, and the prompt lengths and the KV pages left cached agree too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from lint_logs import Breakers, agent_requests
from swarmkv.engine.llm import LLM
from swarmkv.lint.log_file import read_log
from swarmkv.lint.run import lint_log
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer

PAGE_BYTES = 4096  # the replay's page size in bytes: only page counts are compared

pytestmark = [pytest.mark.model, pytest.mark.e2e, pytest.mark.slow]


def swarm_log() -> list[dict[str, Any]]:
    """Three agents, two turns, one shared tool (short prompts: the model runs on the CPU): names above the
    shared instructions, agent 1 without a session (the engine sees loose requests) and with one more tool,
    agent 2 under its own cache salt, and plain completions."""
    records = agent_requests(3, 2, Breakers(private_before_shared=True, tool_added=True), num_tools=1)
    for record in records:
        if record["session_id"] == "agent-1":
            record["session_id"] = None
        if record["session_id"] == "agent-2":
            record["body"]["cache_salt"] = "team-b"
    # The second and third share most and a few tokens of the first's partly filled page: the engine copies
    # that page for the second (at least half a page shared) and not for the third.
    notes = [
        "The swarm's shared notes: keep every change small and tested.",
        "The swarm's shared notes: keep every change small and safe.",
        "The swarm's rules: none.",
    ]
    completions = [
        {"route": "/v1/completions", "session_id": None, "body": {"prompt": text, "max_tokens": 1}}
        for text in notes
    ]
    return [*records[:5], *completions, *records[5:]]


def test_replay_caches_what_the_server_caches(tmp_path: Path) -> None:
    served_log = tmp_path / "served.jsonl"
    llm = LLM(kv_cache_memory="512MiB", max_model_len=4096)
    app = create_app(llm, ServerConfig(log_requests=served_log))
    usages = []
    # Generous: under scalar CPU kernels (ATEN_CPU_CAPABILITY=default) one reply takes over a minute.
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=600) as client:
        for record in swarm_log():
            headers = {"X-Session-Id": record["session_id"]} if record["session_id"] else {}
            response = client.post(record["route"], json=record["body"], headers=headers)
            assert response.status_code == 200, response.text
            usages.append(response.json()["usage"])
        stats = app.state.ctx.engine.call(lambda engine: engine.stats()).result(timeout=600)
    requests, problems = read_log(served_log, strict=True)
    assert len(requests) == len(usages) and not problems
    result = lint_log(requests, llm.tokenizer, llm.engine.config.block_size, PAGE_BYTES, check=True)
    assert [r.prompt_tokens for r in result.requests] == [u["prompt_tokens"] for u in usages]
    served = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert [r.cached_tokens for r in result.requests] == served
    assert sum(served) > 0 and any(
        0 < c < r.prompt_tokens for c, r in zip(served, result.requests, strict=True)
    )
    assert stats["evictions"] == 0
    assert result.kv_bytes // PAGE_BYTES == stats["kv_bytes_used"] // stats["kv_bytes_per_token"] // 16
