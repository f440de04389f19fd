"""Fuzzed bodies over every POST route are never answered 5xx, and leave no KV pages held but the pins'.

Hypothesis posts bytes that are not JSON, JSON values of every type (lone surrogates, huge and non-finite
numbers, nested junk), and valid bodies with one known field (or a nested one) replaced by such a value, to
one server on the scripted checkpoint, whose replies are a few tokens.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from swarmkv import LLM
from swarmkv.models.loader import load_model
from swarmkv.server import create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext

NUM_CASES = 250
USER = [{"role": "user", "content": "Hello"}]
# Each POST route with a body it answers 200 (or 404, the session release), the seed of its mutations.
ROUTES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": USER, "max_tokens": 2},
    "/v1/completions": {"prompt": "Once", "max_tokens": 2},
    "/v1/messages": {"messages": USER, "max_tokens": 2},
    "/v1/messages/count_tokens": {"messages": USER},
    "/v1/responses": {"input": "Hi", "max_output_tokens": 2},
    "/v1/responses/input_tokens": {"input": "Hi"},
    "/v1/cache/pin": {"messages": [{"role": "system", "content": "S"}], "ttl_s": 30},
    "/v1/sessions/fuzz/release": {},
}
# The fields some route reads; a mutation replaces one of them (or adds it).
FIELDS = (
    "messages", "prompt", "input", "model", "max_tokens", "max_completion_tokens", "max_output_tokens",
    "stream", "stream_options", "temperature", "top_p", "top_k", "seed", "stop", "stop_sequences", "n",
    "ignore_eos", "tools", "tool_choice", "cache_salt", "session_id", "prompt_cache_key", "metadata",
    "system", "thinking", "instructions", "previous_response_id", "store", "reasoning", "text",
    "chat_template_kwargs", "enable_thinking", "swarmkv_diagnostics", "ttl_s", "prompt_token_ids",
    "logprobs", "response_format", "output_config", "thread", "include", "truncation",
)  # fmt: skip
JUNK_TEXT = ("\ud800", "a\udfff", "", "\x00", "<|im_start|>", "<tool_call>", "{", "x" * 3000)
HUGE_NUMBERS = (10**30, -(10**30), 2**63, 2**31, -1, 0, 10**300, 1e308, -0.0)

# Text fields the routes read, where a lone surrogate once reached the tokenizer, log or tree.
TEXT_FIELDS = ("content", "prompt", "input", "cache_salt", "session_id", "instructions", "system", "model")

texts = (
    st.text(max_size=12)
    | st.text(st.sampled_from("ab\ud800\udfff\U0001f600"), min_size=1, max_size=6)
    | st.sampled_from(JUNK_TEXT)
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.sampled_from(HUGE_NUMBERS)
    | st.floats(allow_nan=True, allow_infinity=True)
    | texts
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=10,
)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[str, bytes]:
    """A route's valid body with one field, or its first message or that message's content, made junk."""
    route = draw(st.sampled_from(sorted(ROUTES)))
    body = json.loads(json.dumps(ROUTES[route]))
    where = draw(st.sampled_from(("field", "message", "content", "text")))
    value = draw(json_values)
    if where == "text":
        key, text = draw(st.sampled_from(TEXT_FIELDS)), draw(texts)
        if key == "content" and isinstance(body.get("messages"), list):
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body[key] = text
    elif where == "field" or not isinstance(body.get("messages"), list):
        body[draw(st.sampled_from(FIELDS))] = value
    elif where == "message":
        body["messages"] = [value]
    else:
        body["messages"] = [
            {"role": draw(st.sampled_from(("user", "assistant", "system", "tool"))), "content": value}
        ]
    return route, json.dumps(body).encode()


@st.composite
def junk(draw: st.DrawFn) -> tuple[str, bytes]:
    """A route and a body that is no JSON at all, or any JSON value (objects of junk fields among them)."""
    route = draw(st.sampled_from(sorted(ROUTES)))
    raw = draw(st.binary(max_size=40) | json_values.map(lambda value: json.dumps(value).encode()))
    return route, raw


@pytest.fixture(scope="module")
def served(scripted_model_dir: Path) -> Iterator[tuple[str, ServerContext]]:
    llm = LLM(loaded=load_model(scripted_model_dir, dtype="float32"), kv_cache_memory="16MiB", max_num_seqs=4)
    app = create_app(llm)
    with BackgroundServer(app) as server:
        yield server.url, app.state.ctx


def idle_stats(ctx: ServerContext, timeout_s: float = 60.0) -> tuple[dict[str, Any], int]:
    """The engine's stats and pinned pages once nothing runs or waits (or `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats, num_pinned = ctx.engine.call(
            lambda engine: (engine.stats(), engine.core.kv.num_pinned)
        ).result(60)
        idle = stats["requests_running"] == 0 and stats["requests_waiting"] == 0
        if (idle and stats["kv_pages_in_use"] == num_pinned) or time.monotonic() > deadline:
            return stats, num_pinned
        time.sleep(0.05)


def test_fuzzed_bodies_are_never_a_5xx_and_leave_only_pins_holding_pages(
    served: tuple[str, ServerContext],
) -> None:
    url, ctx = served
    statuses: Counter[int] = Counter()
    with httpx.Client(timeout=120, headers={"content-type": "application/json"}) as client:

        @settings(
            max_examples=NUM_CASES,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(case=mutated() | junk())
        def post(case: tuple[str, bytes]) -> None:
            route, raw = case
            response = client.post(f"{url}{route}", content=raw)
            statuses[response.status_code] += 1
            assert response.status_code < 500, (route, raw[:300], response.text[:300])
            if response.status_code == 200:  # a stream's error event: a 5xx after its headers went out
                assert '"server_error"' not in response.text, (route, raw[:300], response.text[:300])

        post()
    num_cases = sum(statuses.values())
    print(
        f"fuzzed {num_cases} bodies over {len(ROUTES)} POST routes: statuses {dict(sorted(statuses.items()))}"
    )
    assert num_cases >= NUM_CASES
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    assert httpx.get(f"{url}/v1/cache/tree", timeout=60).status_code == 200
    stats, num_pinned = idle_stats(ctx)
    assert stats["kv_pages_in_use"] == num_pinned, (stats, num_pinned)
