"""Hostile bodies (issue 53): every parse is bounded and linear, a prompt that cannot fit is refused before it
is tokenized whole, the request log is bounded and names tenants, and nothing in a refusal becomes a 500.

What is bounded is asserted by what was read, tokenized or written (no timed test): a parser handed 20,000
tools refuses them by their count without reading one, the tokenizer only ever sees bounded chunks of a
refused prompt, and a refused 10 MB body adds one short line to the log.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from conftest_tokenizer_helpers import smol_metadata, smol_tokenizer
from swarmkv import LLM
from swarmkv.api.chat_request import parse_chat_request
from swarmkv.api.completion_request import parse_completion_request
from swarmkv.api.errors import APIError
from swarmkv.api.limits import LIMITS, count_json_values
from swarmkv.api.messages_request import parse_messages_request
from swarmkv.api.render import bounded_encode, system_turns_in_place
from swarmkv.api.responses_request import parse_responses_request
from swarmkv.cli import main
from swarmkv.config import ModelConfig
from swarmkv.lint import model as lint_model
from swarmkv.models.loader import load_model
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.cli import short_context_warning
from swarmkv.server.observability.log_entry import MAX_REFUSED_LINE_BYTES, REFUSED_FIELD_CHARS
from swarmkv.server.observability.request_log import NUM_FILES_KEPT, RequestLog
from swarmkv.tokenizer import Tokenizer

EMOJI_10MB = "\U0001f600" * 2_500_000  # 4 UTF-8 bytes each: the probe's 10 MB prompt
JSON = {"content-type": "application/json"}


class Unread(list[Any]):
    """A list that fails the test when anything reads its items: a bound must be checked on its length first."""

    def __iter__(self) -> Iterator[Any]:
        raise AssertionError("the items were read before their count was checked")

    def __getitem__(self, index: Any) -> Any:
        raise AssertionError("the items were read before their count was checked")


def _refusal(call: Any) -> APIError:
    with pytest.raises(APIError) as refused:
        call()
    assert refused.value.status == 400
    return refused.value


# ---- 1. parsing: counts first, linear checks -------------------------------------------------------------


def test_20000_tools_are_refused_by_their_count_before_any_is_read() -> None:
    tools = Unread([{}] * 20_000)
    for parse in (
        lambda: parse_responses_request({"input": "hi", "tools": tools}, []),
        lambda: parse_chat_request({"messages": [{"role": "user", "content": "hi"}], "tools": tools}),
        lambda: parse_messages_request(
            {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": tools}
        ),
    ):
        error = _refusal(parse)
        assert error.code == "too_many_tools" and str(LIMITS.max_tools) in error.message


def test_a_million_stops_are_refused_by_their_count_before_any_is_read() -> None:
    stops = Unread(["a"] * 1_000_000)
    hi = [{"role": "user", "content": "hi"}]
    for parse, param in (
        (lambda: parse_chat_request({"messages": hi, "stop": stops}), "stop"),
        (lambda: parse_completion_request({"prompt": "hi", "stop": stops}), "stop"),
        (lambda: parse_messages_request({"max_tokens": 5, "messages": hi, "stop_sequences": stops}), None),
    ):
        error = _refusal(parse)
        assert error.code == "too_many_stops" and str(LIMITS.max_stop_sequences) in error.message
        assert error.param == (param or "stop_sequences")


class CountingName(str):
    """A tool name that counts the comparisons made with it (a duplicate check by scan compares each pair)."""

    comparisons = 0

    def __eq__(self, other: object) -> bool:
        CountingName.comparisons += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_the_responses_duplicate_name_check_is_a_lookup_not_a_scan() -> None:
    n = LIMITS.max_tools
    tools = [{"type": "function", "name": CountingName(f"tool_{i}")} for i in range(n)]
    CountingName.comparisons = 0
    req = parse_responses_request({"input": "hi", "tools": tools}, [])
    assert len(req.chat.tools or []) == n
    # A scan compares about n^2 / 2 pairs (523,776 here); a set lookup compares on hash collisions only.
    assert CountingName.comparisons < n
    twice = [*tools[:3], {"type": "function", "name": "tool_1"}]
    assert (
        "a second function named 'tool_1'"
        in _refusal(lambda: parse_responses_request({"input": "hi", "tools": twice}, [])).message
    )
    namespace = {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "x"}] * (n + 1)}
    assert _refusal(lambda: parse_responses_request({"input": "hi", "tools": [namespace]}, [])).code == (
        "too_many_tools"
    )


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_schemas_are_bounded_in_depth_and_in_size_on_every_protocol() -> None:
    ok = count_json_values(_nested(LIMITS.max_schema_depth), LIMITS.max_schema_depth, LIMITS.max_schema_nodes)
    assert isinstance(ok, int)
    deep = _nested(LIMITS.max_schema_depth + 1)
    user = [{"role": "user", "content": "hi"}]
    chat_tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    cases = [
        lambda: parse_chat_request({"messages": user, "tools": [chat_tool]}),
        lambda: parse_messages_request(
            {"max_tokens": 5, "messages": user, "tools": [{"name": "f", "input_schema": deep}]}
        ),
        lambda: parse_messages_request(  # a deferred tool is bounded too, though it is not in the prompt
            {
                "max_tokens": 5,
                "messages": user,
                "tools": [{"name": "f", "input_schema": deep, "defer_loading": True}],
            }
        ),
        lambda: parse_responses_request(
            {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": deep}]}, []
        ),
        lambda: parse_chat_request(
            {"messages": user, "response_format": {"type": "json_schema", "json_schema": {"schema": deep}}}
        ),
    ]
    for parse in cases:
        assert _refusal(parse).code == "schema_too_deep"
    # Values are counted over all of a request's schemas together.
    wide = {"type": "object", "enum": list(range(LIMITS.max_schema_nodes // 4))}
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": wide}} for i in range(5)]
    assert _refusal(lambda: parse_chat_request({"messages": user, "tools": tools})).code == "schema_too_large"
    parse_chat_request({"messages": user, "tools": tools[:3]})


def test_the_schema_walk_stops_at_its_bound() -> None:
    assert count_json_values(Unread([0] * 1_000_000), 64, 1000) == "nodes"
    assert count_json_values({"a": [[[[1]]]]}, 3, 1000) == "depth"
    assert count_json_values({"a": [1, 2, {"b": "c"}]}, 8, 1000) == 6


def test_a_repeated_tool_reference_writes_the_definition_once() -> None:
    deferred = {
        "name": "Big",
        "input_schema": {"type": "object", "description": "x" * 1000},
        "defer_loading": True,
    }
    refs = [{"type": "tool_reference", "tool_name": "Big"}] * 500
    call = {"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": refs}
    body = {
        "max_tokens": 5,
        "tools": [{"name": "ToolSearch", "input_schema": {"type": "object"}}, deferred],
        "messages": [
            {"role": "user", "content": "find"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ],
    }
    req = parse_messages_request(body)
    text = next(m for m in req.chat.messages if m["role"] == "tool")["content"]
    assert text.count("x" * 1000) == 1 and text.count("Tool loaded: Big") == 500
    assert [t["function"]["name"] for t in req.chat.loaded_tools or []] == ["Big"]


def test_deeply_nested_arguments_or_user_ids_are_text_not_a_crash() -> None:
    deep = "[" * 100_000
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": deep}}]},
    ]
    req = parse_chat_request({"messages": history})
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == deep
    body = {
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"user_id": "{" + deep},
    }
    assert parse_messages_request(body).user_id is not None


def test_system_turns_folded_into_a_user_turn_are_joined_once() -> None:
    """A template without mid-conversation system turns gets them as reminders in the user turn: 20,000 of them
    join in one pass (joined one at a time, the turn's text was copied 20,000 times)."""
    tokenizer = SimpleNamespace(template=SimpleNamespace(renders_system_in_place=False))
    messages = [{"role": "system", "content": "head"}, {"role": "user", "content": "u"}]
    messages += [{"role": "system", "content": f"s{i}"} for i in range(20_000)]
    messages += [{"role": "assistant", "content": "a"}, {"role": "system", "content": "late"}]
    messages += [{"role": "user", "content": "v"}]
    out = system_turns_in_place(tokenizer, messages)  # type: ignore[arg-type]
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[1]["content"].startswith(
        "u\n\n<system-reminder>\ns0\n</system-reminder>\n\n<system-reminder>\ns1"
    )
    assert out[1]["content"].count("<system-reminder>") == 20_000
    assert out[3]["content"] == "<system-reminder>\nlate\n</system-reminder>\n\nv"


# ---- 2. refused before it is tokenized whole -------------------------------------------------------------


class RecordingTokenizer:
    """A tokenizer that records the length of every text it is asked to encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.encoded_chars: list[int] = []

    def min_num_tokens(self, text: str) -> int:
        return self.tokenizer.min_num_tokens(text)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        self.encoded_chars.append(len(text))
        return self.tokenizer.encode(text, add_special_tokens)

    def encode_text_prompt(self, text: str) -> list[int]:
        return self.encode(text, add_special_tokens=True)


def test_the_fewest_tokens_a_text_can_give_follow_from_the_vocabulary(
    qwen: Tokenizer, smol: Tokenizer
) -> None:
    # Byte-level vocabularies: one character an entry's byte; Qwen's normalizer (NFC) can compose 3 bytes to 1.
    assert qwen.max_token_bytes == 128 and qwen.normalized_shrink == 3
    assert smol.normalized_shrink == 1
    assert qwen.min_num_tokens(EMOJI_10MB) == -(-10_000_000 // (128 * 3))
    text = "the quick brown fox " * 1000
    assert qwen.min_num_tokens(text) <= len(qwen.encode(text))
    assert smol.min_num_tokens(text) <= len(smol.encode(text))


def test_a_10mb_emoji_prompt_is_refused_without_tokenizing(qwen: Tokenizer) -> None:
    recording = RecordingTokenizer(qwen)
    encode = bounded_encode(recording, 8192, "messages")  # type: ignore[arg-type]
    error = _refusal(lambda: encode(EMOJI_10MB))
    assert error.code == "context_length_exceeded" and error.param == "messages"
    assert recording.encoded_chars == []


def test_a_long_prompt_is_counted_in_bounded_chunks_and_stops_past_the_context(qwen: Tokenizer) -> None:
    # A context the byte bound cannot refuse: the count goes chunk by chunk and stops once past it.
    recording = RecordingTokenizer(qwen)
    encode = bounded_encode(recording, 262_144, "messages")  # type: ignore[arg-type]
    assert _refusal(lambda: encode(EMOJI_10MB)).code == "context_length_exceeded"
    assert max(recording.encoded_chars) <= 32_768
    # An emoji is at least a token: what was tokenized is what passes the context (and a chunk), not 2.5 million.
    assert sum(recording.encoded_chars) <= 262_144 + 2 * 32_768


def test_a_prompt_that_fits_is_encoded_whole_as_the_tokenizer_encodes_it(qwen: Tokenizer) -> None:
    text = "Read the file, then edit it.\n" * 5000 + "\U0001f600 done"
    ids = bounded_encode(qwen, 200_000, "messages")(text)
    assert ids == qwen.encode(text)
    exact = bounded_encode(qwen, len(ids), "messages")
    assert exact(text) == ids  # a prompt of exactly the context passes the count


# ---- 3. the request log: capped lines, rotation ----------------------------------------------------------


def test_a_refused_10mb_body_is_one_line_under_64kib_with_its_digest(tmp_path: Path) -> None:
    log = RequestLog(tmp_path / "log.jsonl")
    body = {"messages": [{"role": "user", "content": EMOJI_10MB}], "max_tokens": 2}
    log.write_refused("/v1/chat/completions", 400, "too long", body, "alpha", b"raw")
    log.close()
    raw = (tmp_path / "log.jsonl").read_bytes()
    assert raw.count(b"\n") == 1 and len(raw) <= MAX_REFUSED_LINE_BYTES
    line = json.loads(raw)
    assert line["tenant"] == "alpha" and line["status"] == 400
    assert line["body"]["messages"][0]["content"] == EMOJI_10MB[:REFUSED_FIELD_CHARS]
    (cut,) = line["capped"]
    assert cut == {
        "path": "messages[0].content",
        "chars": len(EMOJI_10MB),
        "kept_chars": REFUSED_FIELD_CHARS,
        "sha256": hashlib.sha256(EMOJI_10MB.encode()).hexdigest(),
    }


def test_a_refused_body_too_big_even_capped_is_named_by_its_size_and_digest(tmp_path: Path) -> None:
    log = RequestLog(tmp_path / "log.jsonl")
    body = {"tools": [{"name": f"t{i}"} for i in range(20_000)]}
    raw = json.dumps(body).encode()
    log.write_refused("/v1/responses", 400, "too many tools", body, None, raw)
    log.write_refused("/v1/responses", 400, "nested", None, None, b"[" * 100_000)
    log.close()
    lines = [json.loads(line) for line in (tmp_path / "log.jsonl").read_bytes().splitlines()]
    assert lines[0]["body"] is None and lines[0]["body_bytes"] == len(raw)
    assert lines[0]["body_sha256"] == hashlib.sha256(raw).hexdigest() and "tenant" not in lines[0]
    assert lines[1]["body"] is None and lines[1]["body_bytes"] == 100_000


def test_an_accepted_body_keeps_strings_up_to_its_prompt_length(tmp_path: Path) -> None:
    log = RequestLog(tmp_path / "log.jsonl")
    body = {"messages": [{"role": "user", "content": "hi"}], "metadata": {"blob": "z" * 100_000}}
    log.write("/v1/chat/completions", None, body, tenant="beta", max_field_chars=5000)
    log.close()
    line = json.loads((tmp_path / "log.jsonl").read_text())
    assert line["tenant"] == "beta" and line["body"]["messages"] == body["messages"]
    assert line["body"]["metadata"]["blob"] == "z" * 5000
    assert [c["path"] for c in line["capped"]] == ["metadata.blob"]


def test_the_log_rotates_by_size_and_keeps_three_files(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    log = RequestLog(path, max_bytes=10_000)
    for i in range(200):
        log.write(
            "/v1/chat/completions", None, {"messages": [{"role": "user", "content": f"{i} " + "a" * 200}]}
        )
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["log.jsonl", "log.jsonl.1", "log.jsonl.2"] and NUM_FILES_KEPT == 3
    assert all((tmp_path / name).stat().st_size <= 10_000 for name in files)
    last = json.loads(path.read_text().splitlines()[-1])
    assert last["body"]["messages"][0]["content"].startswith("199 ")


# ---- a live server: the log on, one tenant ---------------------------------------------------------------

KEY = "key-gamma-1"


@pytest.fixture(scope="module")
def served(scripted_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    folder = tmp_path_factory.mktemp("hostile")
    keys = folder / "keys.txt"
    keys.write_text(f"{KEY} gamma\n")
    log = folder / "requests.jsonl"
    llm = LLM(loaded=load_model(scripted_model_dir, dtype="float32"), kv_cache_memory="16MiB", max_num_seqs=4)
    config = ServerConfig(log_requests=log, api_keys=keys, served_model_name="scripted")
    with BackgroundServer(create_app(llm, config)) as server:
        yield server.url, log


def _post(url: str, route: str, raw: bytes) -> httpx.Response:
    headers = {**JSON, "Authorization": f"Bearer {KEY}"}
    return httpx.post(f"{url}{route}", content=raw, headers=headers, timeout=120)


def _log_lines(log: Path, at_least: int = 0, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The log's lines, once there are `at_least` of them: an accepted request's end line is written off the
    event loop, so it may land after the response has ended."""
    deadline = time.monotonic() + timeout_s
    while True:
        lines = [json.loads(line) for line in log.read_bytes().splitlines()] if log.exists() else []
        if len(lines) >= at_least or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")


def test_deep_nesting_with_the_log_on_is_a_400_and_one_line(served: tuple[str, Path]) -> None:
    url, log = served
    for route in ROUTES:
        before = len(_log_lines(log))
        response = _post(url, route, b"[" * 100_000)
        assert response.status_code == 400, response.text[:200]
        assert "nested too deeply" in response.json()["error"]["message"]
        (line,) = _log_lines(log, before + 1)[before:]
        assert line["route"] == route and line["status"] == 400 and line["tenant"] == "gamma"


def test_a_refused_10mb_prompt_adds_one_short_line(served: tuple[str, Path]) -> None:
    url, log = served
    chat = {"model": "scripted", "messages": [{"role": "user", "content": EMOJI_10MB}], "max_tokens": 2}
    size = log.stat().st_size if log.exists() else 0
    response = _post(url, "/v1/chat/completions", json.dumps(chat).encode())
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    added = log.read_bytes()[size:]
    assert added.count(b"\n") == 1 and len(added) <= 64 * 1024
    line = json.loads(added)
    assert (
        line["status"] == 400 and line["tenant"] == "gamma" and line["capped"][0]["chars"] == len(EMOJI_10MB)
    )


def test_a_request_past_the_context_is_logged_once(served: tuple[str, Path]) -> None:
    url, log = served
    long_text = "word " * 9000  # past the scripted model's 8,192 positions, within the byte bound
    before = len(_log_lines(log))
    chat = {"model": "scripted", "messages": [{"role": "user", "content": long_text}], "max_tokens": 2}
    assert _post(url, "/v1/chat/completions", json.dumps(chat).encode()).status_code == 400
    (line,) = _log_lines(log, before + 1)[before:]
    assert line["status"] == 400
    ok = {"model": "scripted", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert _post(url, "/v1/chat/completions", json.dumps(ok).encode()).status_code == 200
    line, ended = _log_lines(log, before + 3)[before + 1 :]  # the request, then its end
    assert "status" not in line and line["tenant"] == "gamma" and line["body"] == ok
    assert ended["request_id"] == line["request_id"] and "body" not in ended


def test_count_routes_refuse_past_the_context_and_20000_tools(served: tuple[str, Path]) -> None:
    url, _ = served
    messages = [{"role": "user", "content": EMOJI_10MB}]
    counted = _post(url, "/v1/messages/count_tokens", json.dumps({"messages": messages}).encode())
    assert counted.status_code == 400 and "maximum context length" in counted.json()["error"]["message"]
    counted = _post(url, "/v1/responses/input_tokens", json.dumps({"input": "word " * 9000}).encode())
    assert counted.status_code == 400 and counted.json()["error"]["code"] == "context_length_exceeded"
    tools = [{"type": "function", "name": f"t{i}", "parameters": {"type": "object"}} for i in range(20_000)]
    for route in ("/v1/responses", "/v1/responses/input_tokens"):
        response = _post(url, route, json.dumps({"input": "hi", "tools": tools}).encode())
        assert response.status_code == 400 and response.json()["error"]["code"] == "too_many_tools"


# ---- 9. say why ------------------------------------------------------------------------------------------


def test_serve_says_why_a_short_context_refuses_harnesses() -> None:
    warning = short_context_warning(8192)
    assert warning is not None and "9K to 27K" in warning and "--model" in warning and "8192" in warning
    assert short_context_warning(32_768) is None


@pytest.fixture
def fast_model(monkeypatch: pytest.MonkeyPatch) -> None:
    model = lint_model.LintModel("SmolLM2", smol_tokenizer(), ModelConfig.from_gguf_metadata(smol_metadata()))
    monkeypatch.setattr(lint_model, "load_lint_model", lambda path: model)


def test_lint_prints_why_no_request_rendered_and_which_were_capped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fast_model: None
) -> None:
    log = tmp_path / "log.jsonl"
    too_long = {"messages": [{"role": "user", "content": "word " * 9000}], "max_tokens": 2}
    records = [{"time": 1.0, "session_id": None, "route": "/v1/chat/completions", "body": too_long}] * 2
    log.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["lint", str(log)]) == 2
    err = capsys.readouterr().err
    assert "none of the 2 requests" in err and "line 1:" in err and "maximum context length is 8192" in err

    capped = [{"path": "messages[0].content", "chars": 50_000, "kept_chars": 4096, "sha256": "ab"}]
    short = {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2}
    record = {
        "time": 1.0,
        "session_id": "s",
        "route": "/v1/chat/completions",
        "body": short,
        "capped": capped,
    }
    log.write_text(json.dumps(record) + "\n")
    assert main(["lint", str(log)]) == 0
    err = capsys.readouterr().err
    assert "log.jsonl:1: the server's log cut messages[0].content (50000 characters, 4096 kept)" in err
