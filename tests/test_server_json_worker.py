"""The JSON worker (server/http/json_worker.py): a large body decoded in a child process is the object, or the
typed 400, that the server's own `parse_json_body` gives, and a worker that is gone never fails a request."""

from __future__ import annotations

import json
import os
import pickle
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from swarmkv.api.chat_request import CHAT_ARRAYS, parse_chat_request
from swarmkv.api.completion_request import COMPLETION_ARRAYS, parse_completion_request
from swarmkv.api.errors import APIError, parse_json_body
from swarmkv.api.messages_request import MESSAGES_ARRAYS, parse_messages_request
from swarmkv.api.responses_request import RESPONSES_ARRAYS, parse_responses_request
from swarmkv.server.http import json_worker
from swarmkv.server.http.json_worker import SLICE_CHARS, JsonWorker

LONG = "\U0001f600" * (2 * SLICE_CHARS + 5)
BODIES: dict[str, bytes] = {
    "a long prompt, escaped": json.dumps({"messages": [{"role": "user", "content": LONG}]}).encode(),
    "a long prompt, UTF-8": json.dumps(
        {"prompt": LONG, "n": [1, 2.5, None, True]}, ensure_ascii=False
    ).encode(),
    "a long key": json.dumps({"k" * (SLICE_CHARS + 1): {"x": ["y" * (SLICE_CHARS + 2), 3]}}).encode(),
    "many short values": json.dumps({"stop": ["a", "b"] * 50_000, "nested": [[["z"]]]}).encode(),
    "nested 900 deep": b'{"a": ' + b"[" * 900 + b"]" * 900 + b"}",
    "not JSON": b'\xff{"messages": [',
    "an array": b"[1, 2]",
    "nested too deeply": b'{"a": ' + b"[" * 100_000,
    "a lone surrogate": b'{"messages": [{"content": "\\ud800"}]}',
}


@pytest.fixture(scope="module")
def worker() -> Iterator[JsonWorker]:
    decoder = JsonWorker()
    yield decoder
    decoder.close()


def _outcome(decode: Any, raw: bytes) -> tuple[str, Any]:
    try:
        return "body", decode(raw)
    except APIError as exc:
        return "400", (exc.status, exc.message, exc.param, exc.code, exc.error_type)


@pytest.mark.parametrize("name", list(BODIES))
def test_the_worker_answers_what_the_server_would(worker: JsonWorker, name: str) -> None:
    raw = BODIES[name]
    assert _outcome(worker.decode, raw) == _outcome(parse_json_body, raw)
    assert worker.pid is not None and worker.pid != os.getpid()


def test_long_strings_go_back_in_slices_that_join_to_the_string() -> None:
    body = {"k" * (SLICE_CHARS + 1): {"x": ["y" * (3 * SLICE_CHARS + 2), 3]}}
    data = json_worker._pickled(json_worker.sliced(json.loads(json.dumps(body))))
    reader = json_worker._SteppedReader(data)
    reads = []
    original = reader.read

    def counted(size: int = -1) -> bytes:
        reads.append(size)
        return original(size)

    reader.read = counted
    assert pickle.Unpickler(reader).load() == body
    # Each slice is read by a call of its own, between which the server's other threads may run.
    assert sum(size >= SLICE_CHARS for size in reads) == 4  # the key's one whole slice, the value's three


def test_a_worker_killed_between_bodies_is_started_again(worker: JsonWorker) -> None:
    raw = BODIES["a long prompt, escaped"]
    worker.decode(raw)
    first = worker.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    assert worker._process is not None
    worker._process.wait()  # dead before the next body comes (one dying while it is sent: the test below)
    assert worker.decode(raw) == parse_json_body(raw)
    assert worker.pid not in (None, first)


def test_a_worker_dying_with_a_body_leaves_it_to_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    decoder = JsonWorker()
    raw = BODIES["a long prompt, escaped"]
    decoder.decode(raw)
    started = decoder.pid

    def died(raw: bytes, counted: object) -> tuple[int, bytes]:
        raise EOFError("the worker's answer ended after 0 of 9 bytes")

    monkeypatch.setattr(decoder, "_ask", died)
    assert decoder.decode(raw) == parse_json_body(raw)
    with pytest.raises(APIError) as refused:
        decoder.decode(BODIES["not JSON"])
    assert refused.value.message == _outcome(parse_json_body, BODIES["not JSON"])[1][1]
    assert decoder.pid is None and started is not None  # stopped; the next body starts another
    monkeypatch.undo()
    assert decoder.decode(raw) == parse_json_body(raw) and decoder.pid not in (None, started)
    decoder.close()


def test_a_closed_worker_decodes_in_the_server() -> None:
    decoder = JsonWorker()
    decoder.close()
    raw = BODIES["a long prompt, UTF-8"]
    assert decoder.decode(raw) == parse_json_body(raw)
    assert decoder.pid is None
    with pytest.raises(APIError) as refused:
        decoder.decode(BODIES["an array"])
    assert refused.value.status == 400


# Each API's counted arrays, a body over one of their bounds, and the API's parser.
COUNTED = [
    ("responses", RESPONSES_ARRAYS, {"input": "hi", "tools": [{"type": "function"}] * 2_000}),
    ("chat tools", CHAT_ARRAYS, {"messages": [], "tools": [{}] * 2_000, "stop": "x"}),
    ("chat stops", CHAT_ARRAYS, {"messages": [], "stop": ["a"] * 100}),
    ("messages", MESSAGES_ARRAYS, {"max_tokens": 5, "messages": [], "stop_sequences": ["a"] * 100}),
    ("completions", COMPLETION_ARRAYS, {"prompt": "hi", "stop": ["a"] * 100}),
]
PARSERS: dict[str, Any] = {
    "responses": lambda body: parse_responses_request(body, []),
    "chat tools": parse_chat_request,
    "chat stops": parse_chat_request,
    "messages": parse_messages_request,
    "completions": parse_completion_request,
}


@pytest.mark.parametrize(("name", "counted", "body"), COUNTED, ids=[case[0] for case in COUNTED])
def test_a_count_past_its_bound_is_refused_in_the_worker_as_the_parser_refuses_it(
    worker: JsonWorker, name: str, counted: tuple[str, ...], body: dict[str, Any]
) -> None:
    raw = json.dumps(body).encode()
    refused = _outcome(lambda raw: worker.decode(raw, counted), raw)
    assert refused[0] == "400" and refused[1][3] in ("too_many_tools", "too_many_stops")
    assert refused == _outcome(lambda raw: PARSERS[name](parse_json_body(raw)), raw)
    # Uncounted, the same body comes back whole: the route's arrays alone are counted.
    assert worker.decode(raw) == body
