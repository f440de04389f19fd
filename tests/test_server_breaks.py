"""Request logs and live cache breaks: `--log-requests` lines, and the break a session's prompt edit causes.

One server over a tiny random Qwen3 checkpoint (the real tokenizer and chat template) logs its requests to
a file. A timestamp rewritten in a session's system prompt must come back as a `timestamp` break at the
first token that changed, in `usage.swarmkv` (whole and streamed), in /metrics and in the log; a turn
that continues the session's previous prompt must come back as `cache_break: null`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarmkv.engine.llm import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext
from tiny_models import make_tiny_checkpoint

BLOCK = 16
SYSTEM = "You are a build agent. Current time: {when}. Run the tests, then report what failed and why."


@dataclass(frozen=True)
class Served:
    http: httpx.Client
    ctx: ServerContext
    log_path: Path

    def chat(self, messages: list[dict[str, str]], **fields: Any) -> httpx.Response:
        body = {"messages": messages, "max_tokens": 3, "temperature": 0, **fields}
        return self.http.post("/v1/chat/completions", json=body)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.ctx.tokenizer.apply_chat_template(messages)
        return self.ctx.tokenizer.encode(text, add_special_tokens=False)

    def breaks_total(self, cause: str) -> float:
        text = self.http.get("/metrics").text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "swarmkv_cache_breaks_total" and sample.labels == {"cause": cause}:
                    return sample.value
        return 0.0


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("breaks") / "qwen3", "qwen3")
    log_path = tmp_path_factory.mktemp("logs") / "requests.jsonl"
    llm = LLM(str(folder), kv_cache_memory="8MiB", block_size=BLOCK, max_model_len=512)
    app = create_app(llm, ServerConfig(served_model_name="tiny", log_requests=log_path))
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        yield Served(http, app.state.ctx, log_path)


def _system(when: str) -> dict[str, str]:
    return {"role": "system", "content": SYSTEM.format(when=when)}


def _stream_usage(response: httpx.Response) -> dict[str, Any]:
    """The usage object of a streamed reply's final usage chunk."""
    chunks = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    final = json.loads(chunks[-2])
    assert final["choices"] == []
    return final["usage"]


def test_each_generation_request_is_one_whole_log_line(served: Served) -> None:
    before = time.time()
    start = len(served.log_path.read_text().splitlines()) if served.log_path.exists() else 0
    chat = {"messages": [{"role": "user", "content": "héllo"}], "max_tokens": 2, "session_id": "log-a"}
    assert served.http.post("/v1/chat/completions", json=chat).status_code == 200
    completion = {"prompt": "Once upon", "max_tokens": 2, "unknown_field": [1, {"x": None}]}
    headers = {"X-Session-Id": "log-b"}
    assert served.http.post("/v1/completions", json=completion, headers=headers).status_code == 200
    assert served.http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1}).status_code == 200
    refused_status = served.http.post("/v1/completions", json={"prompt": 5}).status_code  # refused, logged
    assert refused_status == 400

    lines = served.log_path.read_text(encoding="utf-8").splitlines()[start:]
    records = [json.loads(line) for line in lines]
    ended = [r for r in records if "body" not in r]  # each request that ran ends with a line of its own
    records = [r for r in records if "body" in r]
    ran, refused = records[:3], records[3:]
    assert [r["request_id"] for r in ended] == [r["request_id"] for r in ran]
    assert all(r["cached_tokens"] <= r["prompt_tokens"] for r in ended)
    assert [(r["route"], r["session_id"]) for r in ran] == [
        ("/v1/chat/completions", "log-a"),
        ("/v1/completions", "log-b"),
        ("/v1/completions", None),
    ]
    assert [r["body"] for r in ran] == [chat, completion, {"prompt": [1, 2, 3], "max_tokens": 1}]
    assert all(set(r) == {"time", "session_id", "route", "request_id", "body"} for r in ran)
    assert [(r["route"], r["status"], r["body"]) for r in refused] == [
        ("/v1/completions", 400, {"prompt": 5})
    ]
    assert "prompt" in refused[0]["error"]
    assert all(before <= r["time"] <= time.time() and isinstance(r["time"], float) for r in records)


def test_a_rewritten_timestamp_is_a_timestamp_break_at_its_first_changed_token(
    served: Served, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="swarmkv.server.observability.cache_breaks")
    user = {"role": "user", "content": "The build is red again."}
    first = [_system("2025-03-14 09:26:53"), user]
    second = [_system("2025-03-14 09:31:07"), user]
    third = [_system("2025-03-14 10:02:44"), user]
    diag = {"session_id": "agent-time", "swarmkv_diagnostics": True}
    before = served.breaks_total("timestamp")

    reply = served.chat(first, **diag)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["swarmkv"] == {"cache_break": None}  # nothing earlier to compare with

    reply = served.chat(second, **diag)
    offset = len(os.path.commonprefix([served.prompt_ids(first), served.prompt_ids(second)]))
    assert 0 < offset < len(served.prompt_ids(first))
    assert reply.json()["usage"]["swarmkv"] == {"cache_break": {"offset": offset, "cause": "timestamp"}}

    # Streamed: the break rides in the final usage chunk, which diagnostics ask for on their own.
    streamed = served.chat(third, stream=True, **diag)
    offset = len(os.path.commonprefix([served.prompt_ids(second), served.prompt_ids(third)]))
    usage = _stream_usage(streamed)
    assert usage["swarmkv"] == {"cache_break": {"offset": offset, "cause": "timestamp"}}
    assert usage["prompt_tokens"] == len(served.prompt_ids(third))

    assert served.breaks_total("timestamp") == before + 2
    logged = [r.getMessage() for r in caplog.records if "cache break" in r.getMessage()]
    assert len(logged) == 2 and all("session=agent-time" in m and "cause=timestamp" in m for m in logged)
    assert f"offset={offset}" in logged[-1]


def test_a_turn_that_continues_the_last_prompt_is_no_break(served: Served) -> None:
    before = {cause: served.breaks_total(cause) for cause in ("timestamp", "other", "history_rewrite")}
    system = _system("2025-03-14 09:26:53")
    first = [system, {"role": "user", "content": "Which test failed?"}]
    second = [*first, {"role": "assistant", "content": "test_cache."}, {"role": "user", "content": "Fix it."}]
    earlier, later = served.prompt_ids(first), served.prompt_ids(second)
    assert later[: len(earlier)] == earlier  # the template renders the new turn as a continuation

    diag = {"session_id": "agent-clean", "swarmkv_diagnostics": True}
    assert served.chat(first, **diag).json()["usage"]["swarmkv"] == {"cache_break": None}
    streamed = served.chat(second, stream=True, stream_options={"include_usage": True}, **diag)
    assert _stream_usage(streamed)["swarmkv"] == {"cache_break": None}
    assert {cause: served.breaks_total(cause) for cause in before} == before


def test_breaks_are_found_within_a_salt_and_diagnostics_are_opt_in(served: Served) -> None:
    user = {"role": "user", "content": "Summarise the failures."}
    first = [_system("2025-01-01 00:00:00"), user]
    second = [_system("2025-01-02 00:00:00"), user]
    plain = served.chat(first, cache_salt="team-a")
    assert "swarmkv" not in plain.json()["usage"]  # not asked for
    found = served.chat(second, cache_salt="team-a", swarmkv_diagnostics=True).json()["usage"]["swarmkv"]
    offset = len(os.path.commonprefix([served.prompt_ids(first), served.prompt_ids(second)]))
    assert found["cache_break"]["offset"] == offset
    # Without a session or a salt, a prompt is compared with nothing: unrelated agents diverge by design.
    anonymous = served.chat(first, swarmkv_diagnostics=True).json()["usage"]["swarmkv"]
    assert anonymous == {"cache_break": None}


def test_a_malformed_diagnostics_flag_is_a_400(served: Served) -> None:
    reply = served.chat([{"role": "user", "content": "hi"}], swarmkv_diagnostics="yes")
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "swarmkv_diagnostics"
