"""Honest usage and logs on the Messages API, on the scripted checkpoint: the usage of a turn whose
`cache_control` marks moved adds up to its prompt and says what was read from the cache, pins count under
their own counters, the log's end lines and the `X-Request-Id` header name what the prefix cache served each
request, and refused requests reach the `--log-requests` log with their status and error (a body
that is not valid text logged escaped)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from swarmkv.engine.llm import LLM
from swarmkv.lint.log_file import read_log_file
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext
from swarmkv.server.observability.request_log import RequestLog

API_KEY = "test-key"
TIMEOUT_S = 600.0
EPHEMERAL = {"type": "ephemeral"}
# One token a byte on the scripted checkpoint: some 1,500 tokens of static head.
SYSTEM = " ".join(f"Rule {i}: keep every change small, tested and explained." for i in range(30))
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@dataclass(frozen=True)
class Served:
    url: str
    ctx: ServerContext
    log_path: Path

    def post(self, body: Any, path: str = "/v1/messages") -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers={"x-api-key": API_KEY}, timeout=TIMEOUT_S)

    def post_raw(self, content: bytes, path: str = "/v1/messages") -> httpx.Response:
        headers = {"x-api-key": API_KEY, "content-type": "application/json"}
        return httpx.post(self.url + path, content=content, headers=headers, timeout=TIMEOUT_S)

    def stats(self) -> dict[str, Any]:
        return self.ctx.engine.call(lambda engine: engine.stats()).result(timeout=TIMEOUT_S)

    def log_lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log_path.read_text(encoding="ascii").splitlines()]

    def lines_of(self, request_id: str, timeout_s: float = 10.0) -> tuple[dict[str, Any], dict[str, Any]]:
        """A request's first and last log lines once its end line is there: the end line is written off the
        event loop, so it may land after the response has ended."""
        deadline = time.monotonic() + timeout_s
        while True:
            lines = [line for line in self.log_lines() if line.get("request_id") == request_id]
            ends = [line for line in lines if "cached_tokens" in line]
            if ends or time.monotonic() > deadline:
                assert lines and ends, f"no request line and end line name {request_id}: {lines}"
                return lines[0], ends[-1]
            time.sleep(0.02)


@pytest.fixture(scope="module")
def served(scripted_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    llm = LLM(
        str(scripted_model_dir), dtype="float32", kv_cache_memory="32MiB", max_model_len=8192, max_num_seqs=4
    )
    log_path = tmp_path_factory.mktemp("log") / "requests.jsonl"
    app = create_app(llm, ServerConfig(api_key=API_KEY, served_model_name="scripted", log_requests=log_path))
    with BackgroundServer(app) as server:
        ctx: ServerContext = app.state.ctx
        yield Served(server.url, ctx, log_path)
        ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=TIMEOUT_S)


def _body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """Claude Code's shape: the system block marked, and a mark on the last message's last block."""
    system = [{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}]
    return {"model": "scripted", "system": system, "tools": [WEATHER], "messages": messages, "max_tokens": 64}


def _marked(message: dict[str, Any]) -> dict[str, Any]:
    *head, last = message["content"]
    return {**message, "content": [*head, {**last, "cache_control": EPHEMERAL}]}


def _prompt_length(served: Served, body: dict[str, Any]) -> int:
    counted = served.post({k: v for k, v in body.items() if k != "max_tokens"}, "/v1/messages/count_tokens")
    assert counted.status_code == 200, counted.text
    return int(counted.json()["input_tokens"])


def _sum(usage: dict[str, int]) -> int:
    return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]


def test_usage_adds_up_and_a_moved_mark_reads_from_the_cache(served: Served) -> None:
    ask = {"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?"}]}
    first_body = _body([_marked(ask)])
    first = served.post(first_body)
    assert first.status_code == 200, first.text
    usage = first.json()["usage"]
    num_tokens = _prompt_length(served, first_body)
    assert _sum(usage) == num_tokens, usage
    # A cold prompt: its marks' pins computed nearly all of it, and nothing was there to read.
    assert usage["cache_creation_input_tokens"] >= num_tokens - 64, usage
    assert usage["cache_read_input_tokens"] < 32, usage
    (call,) = [b for b in first.json()["content"] if b["type"] == "tool_use"]
    result = {"type": "tool_result", "tool_use_id": call["id"], "content": "Sunny, 21 C"}
    # The next turn moves the message mark to its new last block, as Claude Code does every turn.
    second_body = _body(
        [ask, {"role": "assistant", "content": [call]}, _marked({"role": "user", "content": [result]})]
    )
    before = served.stats()
    second = served.post(second_body)
    assert second.status_code == 200, second.text
    after = served.stats()
    usage = second.json()["usage"]
    num_tokens = _prompt_length(served, second_body)
    assert _sum(usage) == num_tokens, usage
    assert usage["cache_read_input_tokens"] >= 0.8 * num_tokens, usage  # the first turn's prompt
    assert 0 < usage["cache_creation_input_tokens"] < 0.2 * num_tokens, usage  # the new call and result
    # The pins' prefills count apart: the request's own positions are its prompt, each once.
    assert after["prompt_tokens"] - before["prompt_tokens"] == num_tokens
    assert after["pin_prompt_tokens"] > before["pin_prompt_tokens"]
    assert after["pin_prefill_tokens_computed"] > before["pin_prefill_tokens_computed"]
    assert after["prefill_tokens_computed"] == (
        after["prompt_tokens"] - after["prefix_hit_tokens"] + after["recomputed_tokens"]
    )
    metrics = httpx.get(f"{served.url}/metrics", headers={"x-api-key": API_KEY}, timeout=TIMEOUT_S).text
    samples = dict(line.rsplit(" ", 1) for line in metrics.splitlines() if line.startswith("swarmkv_pin_"))
    assert float(samples["swarmkv_pin_prompt_tokens_total"]) >= after["pin_prompt_tokens"] > 0


def test_a_refused_request_is_logged_with_its_status_and_error(served: Served) -> None:
    response = served.post({"model": "scripted", "max_tokens": 5})
    assert response.status_code == 400, response.text
    error = response.json()["error"]["message"]
    line = served.log_lines()[-1]
    assert (line["route"], line["status"], line["error"]) == ("/v1/messages", 400, error)
    assert line["body"] == {"model": "scripted", "max_tokens": 5}
    ask = [{"role": "user", "content": "Hi."}]
    response = served.post({"model": "not-served", "messages": ask}, "/v1/chat/completions")
    assert response.status_code == 404
    line = served.log_lines()[-1]
    assert (line["route"], line["status"]) == ("/v1/chat/completions", 404)


def test_a_body_that_is_not_valid_text_is_logged_escaped(served: Served) -> None:
    lone = b'{"model": "scripted", "max_tokens": 5, "messages": "\\ud800"}'  # a lone surrogate, escaped
    assert served.post_raw(lone).status_code == 400
    raw_line = served.log_path.read_bytes().splitlines()[-1]
    assert b"\\ud800" in raw_line
    assert json.loads(raw_line)["body"]["messages"] == "\ud800"
    assert served.post_raw(b'{"model": "\xff\xfe"}').status_code == 400  # not UTF-8 at all
    line = served.log_lines()[-1]
    assert line["status"] == 400 and isinstance(line["body"], str)
    # Accepted requests go through the same writer: a lone surrogate in a body logs, it does not raise.
    log = RequestLog(served.log_path)
    log.write("/v1/chat/completions", None, {"messages": [{"role": "user", "content": "a\udc80b"}]})
    log.close()
    assert served.log_lines()[-1]["body"]["messages"][0]["content"] == "a\udc80b"


def test_the_log_says_what_the_cache_served_each_request(served: Served) -> None:
    ask = {"role": "user", "content": [{"type": "text", "text": "What is the weather in Lyon?"}]}
    body = {**_body([_marked(ask)]), "stream": True}
    num_lines, hits_before = len(served.log_lines()), served.stats()["prefix_hit_tokens"]
    for _ in range(2):  # cold, then warm
        with httpx.stream(
            "POST", served.url + "/v1/messages", json=body, headers={"x-api-key": API_KEY}, timeout=TIMEOUT_S
        ) as response:
            assert response.status_code == 200
            request_id = response.headers["x-request-id"]
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        usage = next(e for e in events if e["type"] == "message_delta")["usage"]
        # The request's line names it; its end line follows, with what the server's prefix cache served it.
        logged, ended = served.lines_of(request_id)
        assert logged["request_id"] == ended["request_id"] == request_id and "body" not in ended
        assert ended["prompt_tokens"] == _sum(usage)
        assert (
            ended["cached_tokens"] == usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
        )
        assert ended["pin_computed_tokens"] == usage["cache_creation_input_tokens"]
    assert usage["cache_read_input_tokens"] >= 0.9 * ended["prompt_tokens"], usage
    new_lines = served.log_lines()[num_lines:]
    assert served.stats()["prefix_hit_tokens"] - hits_before == sum(
        line["cached_tokens"] for line in new_lines if "body" not in line
    )
    # Lint reads end lines as what they are, not as malformed requests.
    log = read_log_file(served.log_path)
    assert not log.problems and log.ended[-1].request_id == request_id
