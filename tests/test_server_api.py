"""The OpenAI-compatible server end to end: the official client, sync and async, against a live uvicorn.

One server (real default model, API key required) serves the whole module; every test leaves it idle,
and the last ones check that its counters add up and its pages all came back.

The default model computes in int4 with bfloat16 activations, whose rounding depends on the shapes of a
step and on the CPU. So two replies are compared only when both computed the same tokens with the same
shapes: a test first sends the prompt once to warm the prefix cache, and the identical requests after it
all find the same cached pages, run alone, and agree on any machine. A cold request and a warm one
compute different shapes and may not.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from swarmkv.engine.llm import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.app import default_model_name
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext
from swarmkv.swarm.http_driver import run_swarm_over_http
from swarmkv.swarm.workload import build_workload, prefix_token_count

API_KEY = "test-key"
# Generous: a reply takes minutes on a slow CPU, or under ATEN_CPU_CAPABILITY=default's scalar kernels.
TIMEOUT_S = 600.0
MAX_MODEL_LEN = 1024
AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Search the documentation",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
        },
    },
]
# Long enough to fill several 16-token pages, so that a second agent's prompt can hit them.
SYSTEM = (
    "You are a careful assistant for a team of software engineers. Answer briefly and precisely. "
    "Prefer concrete examples over general advice. When you are unsure, say so and explain what you "
    "would check. Never invent file names, functions or command line flags. Keep answers under three "
    "sentences unless asked for more detail. Use the tools when they help: get_weather for weather "
    "questions and search_docs for questions about the project's documentation."
)


pytestmark = [pytest.mark.model, pytest.mark.e2e]


@dataclass(frozen=True)
class Served:
    url: str
    ctx: ServerContext
    model: str

    def stats(self) -> dict[str, Any]:
        stats = self.ctx.engine.call(lambda engine: engine.stats()).result(timeout=TIMEOUT_S)
        return {**stats, "requests_aborted": self.ctx.engine.num_aborted}

    def check_integrity(self) -> None:
        self.ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=TIMEOUT_S)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S
        )


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    llm = LLM(kv_cache_memory="96MiB", max_model_len=MAX_MODEL_LEN, max_num_seqs=16)
    # The names restricted to the model's own, so that another name is a 404.
    app = create_app(llm, ServerConfig(api_key=API_KEY, served_model_name=default_model_name(llm)))
    with BackgroundServer(app) as server:
        ctx: ServerContext = app.state.ctx
        yield Served(server.url, ctx, ctx.model_name)
        ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=TIMEOUT_S)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, keyed by sample name and sorted labels, parsed by prometheus_client."""
    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=TIMEOUT_S).text  # /metrics needs the key too
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def metric(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_idle(served: Served, timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = served.stats()
        idle = stats["requests_running"] == 0 and stats["requests_waiting"] == 0
        if (idle and stats["kv_pages_in_use"] == 0) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def chat(served: Served, content: str, **kwargs: Any) -> Any:
    messages = [{"role": "user", "content": content}]
    return served.client().chat.completions.create(model=served.model, messages=messages, **kwargs)


def test_models_health_and_api_key(served: Served) -> None:
    assert [m.id for m in served.client().models.list().data] == [served.model]
    assert httpx.get(f"{served.url}/health").json() == {"status": "ok"}
    # Clients probe the root before their first request (Claude Code: `HEAD /`); it needs no key.
    assert httpx.head(served.url).status_code == 200
    assert httpx.get(served.url).json()["models"] == [served.model]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{served.url}/v1/chat/completions", json={}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="nope", max_retries=0).models.list()


def test_chat_stream_matches_whole_reply_and_reports_usage(served: Served) -> None:
    first = chat(served, "Name three colors.", max_tokens=12, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens is not None
    whole = chat(served, "Name three colors.", max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(
        chat(
            served,
            "Name three colors.",
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    # The second and third, identical prompts found the first one's full pages in the prefix cache. The last
    # token is always computed, so that there is something to sample; the tokens before it on the first
    # request's partly filled last page are copied from it when they are at least half a page, and recomputed
    # otherwise. Both found as much: they computed the same tokens.
    prompt = whole.usage.prompt_tokens
    expected = prompt - 1 if (prompt - 1) % 16 >= 8 else (prompt - 1) // 16 * 16
    assert whole.usage.prompt_tokens_details.cached_tokens == expected
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == expected


def test_async_client_chat_and_completions(served: Served) -> None:
    async def run() -> None:
        client = served.async_client()
        messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Count to five."}]
        for _ in range(2):  # the first warms the cache for the second and the stream
            whole = await client.chat.completions.create(
                model=served.model, messages=messages, max_tokens=10, temperature=0
            )
        stream = await client.chat.completions.create(
            model=served.model, messages=messages, max_tokens=10, temperature=0, stream=True
        )
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        assert streamed == whole.choices[0].message.content

        prompt = "The three primary colors are"
        for _ in range(2):
            done = await client.completions.create(
                model=served.model, prompt=prompt, max_tokens=8, temperature=0
            )
        assert done.object == "text_completion" and done.usage.completion_tokens <= 8
        pieces = await client.completions.create(
            model=served.model,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in pieces]
        assert "".join(c.choices[0].text for c in chunks if c.choices) == done.choices[0].text
        assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens

    asyncio.run(run())


def _a_word_in(text: str) -> str:
    words = [w.strip(" ,.") for w in text.split() if len(w.strip(" ,.")) >= 3]
    return words[1] if len(words) > 1 else words[0]


def test_stop_sequences_cut_the_text_and_finish_with_stop(served: Served) -> None:
    client = served.client()
    common: dict[str, Any] = {
        "model": served.model,
        "max_tokens": 24,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    prompt = "Here is a list of fruits: apple, banana, cherry,"
    client.completions.create(prompt=prompt, **common)  # warms the cache: the three below then agree
    text = client.completions.create(prompt=prompt, **common).choices[0].text
    stop = _a_word_in(text)  # a string the greedy reply certainly contains
    expected = text[: text.index(stop)]
    cut = client.completions.create(prompt=prompt, stop=[stop, "@@@"], **common)
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (expected, "stop")
    chunks = list(client.completions.create(prompt=prompt, stop=stop, stream=True, **common))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"

    messages = [{"role": "user", "content": "List five animals."}]
    client.chat.completions.create(messages=messages, **common)
    reply = client.chat.completions.create(messages=messages, **common).choices[0].message.content or ""
    stop = _a_word_in(reply)
    cut_reply = client.chat.completions.create(messages=messages, stop=stop, **common).choices[0]
    assert (cut_reply.message.content, cut_reply.finish_reason) == (reply[: reply.index(stop)], "stop")


def _check_weather_call(calls: list[Any]) -> None:
    assert len(calls) == 1 and calls[0].type == "function" and calls[0].id.startswith("call_")
    assert calls[0].function.name == "get_weather"
    assert isinstance(json.loads(calls[0].function.arguments), dict)


def test_forced_tool_call_is_parsed_whole_and_streamed(served: Served) -> None:
    # SmolLM2-135M rarely calls a tool on its own; a forced call starts its reply inside the call block,
    # and with one tool offered it completes valid JSON arguments.
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs: dict[str, Any] = {"tools": TOOLS[:1], "tool_choice": choice, "max_tokens": 48, "temperature": 0}
    chat(served, "What is the weather in Paris?", **kwargs)  # warms the cache for the two compared below
    whole = chat(served, "What is the weather in Paris?", **kwargs)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.content is None
    _check_weather_call(whole.choices[0].message.tool_calls)

    chunks = list(chat(served, "What is the weather in Paris?", stream=True, **kwargs))
    fragments = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    # The arguments stream in pieces as they are written; the first fragment names the call.
    assert len(fragments) > 1 and {f.index for f in fragments} == {0}
    assert all(f.id is None and f.function.name is None for f in fragments[1:])
    first = fragments[0]
    assert (first.type, first.function.name) == ("function", "get_weather") and first.id.startswith("call_")
    streamed = "".join(f.function.arguments or "" for f in fragments)
    assert json.loads(streamed) == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    async def run() -> None:
        client = served.async_client()
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        reply = await client.chat.completions.create(
            model=served.model,
            messages=messages,
            tools=TOOLS[:1],
            tool_choice="required",
            max_tokens=48,
            temperature=0,
        )
        assert reply.choices[0].finish_reason == "tool_calls"
        _check_weather_call(reply.choices[0].message.tool_calls)

    asyncio.run(run())


def test_tool_call_history_and_results_round_trip(served: Served) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 24 C"},
    ]
    client = served.client()
    reply = client.chat.completions.create(
        model=served.model, messages=messages, tools=TOOLS, max_tokens=16, temperature=0
    )
    shorter = client.chat.completions.create(
        model=served.model, messages=messages[:2], tools=TOOLS, max_tokens=1, temperature=0
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert reply.choices[0].message.content or reply.choices[0].message.tool_calls
    assert (
        reply.usage.prompt_tokens > shorter.usage.prompt_tokens + 10
    )  # the call and its result were rendered


def test_second_agent_hits_the_shared_system_prompt(served: Served) -> None:
    client = served.client()
    system = {"role": "system", "content": "Session 7. " + SYSTEM}  # no earlier test cached this head

    def ask(question: str, salt: str | None = None) -> Any:
        extra = {"cache_salt": salt} if salt else None
        messages = [system, {"role": "user", "content": question}]
        return client.chat.completions.create(
            model=served.model, messages=messages, max_tokens=2, temperature=0, extra_body=extra
        ).usage

    tokenizer = served.ctx.tokenizer
    head = len(tokenizer.encode(tokenizer.apply_chat_template([system], add_generation_prompt=False)))
    first = ask("Agent one: how do I run the tests?")
    second = ask("Agent two: where is the changelog?")
    assert first.prompt_tokens_details.cached_tokens == 0
    # The whole pages of the head, and maybe a copy of the page where the two prompts part.
    assert head // 16 * 16 <= second.prompt_tokens_details.cached_tokens < second.prompt_tokens

    # A tenant with its own salt never hits pages computed under another salt (or none) ...
    tenant_a = ask("Agent two: where is the changelog?", salt="tenant-a")
    assert tenant_a.prompt_tokens_details.cached_tokens == 0
    # ... but does hit its own.
    again = ask("Agent three: what is a fixture?", salt="tenant-a")
    assert again.prompt_tokens_details.cached_tokens >= head // 16 * 16
    tenant_b = ask("Agent three: what is a fixture?", salt="tenant-b")
    assert tenant_b.prompt_tokens_details.cached_tokens == 0


def _bad_requests(model: str) -> list[tuple[str, str, Any, int, str | None]]:
    """(name, path, body (bytes are sent raw), status, OpenAI error code or param expected)."""
    user = [{"role": "user", "content": "hi"}]
    long_prompt = "word " * (MAX_MODEL_LEN + 50)
    return [
        ("malformed json", "/v1/chat/completions", b'{"model": "x", "messages": [', 400, None),
        ("not an object", "/v1/chat/completions", b"[]", 400, None),
        ("messages not a list", "/v1/chat/completions", {"model": model, "messages": "hi"}, 400, "messages"),
        ("empty messages", "/v1/chat/completions", {"model": model, "messages": []}, 400, "messages"),
        (
            "message without role",
            "/v1/chat/completions",
            {"model": model, "messages": [{"content": "x"}]},
            400,
            "messages[0].role",
        ),
        (
            "temperature as text",
            "/v1/chat/completions",
            {"model": model, "messages": user, "temperature": "hot"},
            400,
            "temperature",
        ),
        (
            "max_tokens as text",
            "/v1/chat/completions",
            {"model": model, "messages": user, "max_tokens": "5"},
            400,
            "max_tokens",
        ),
        (
            "unknown model",
            "/v1/chat/completions",
            {"model": "gpt-17", "messages": user},
            404,
            "model_not_found",
        ),
        (
            "prompt over the context",
            "/v1/chat/completions",
            {"model": model, "messages": [{"role": "user", "content": long_prompt}]},
            400,
            "context_length_exceeded",
        ),
        (
            "tool_choice not among tools",
            "/v1/chat/completions",
            {
                "model": model,
                "messages": user,
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "rm"}},
            },
            400,
            "tool_choice",
        ),
        (
            "completion prompt over the context",
            "/v1/completions",
            {"model": model, "prompt": long_prompt},
            400,
            "context_length_exceeded",
        ),
        (
            "token id outside the vocabulary",
            "/v1/completions",
            {"model": model, "prompt": [1, 10**9]},
            400,
            None,
        ),
        ("empty completion prompt", "/v1/completions", {"model": model, "prompt": ""}, 400, None),
        ("unknown route", "/v1/embeddings", {"model": model, "input": "x"}, 404, None),
    ]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served: Served) -> None:
    for name, path, body, status, expected in _bad_requests(served.model):
        if isinstance(body, bytes):
            response = httpx.post(
                served.url + path, content=body, headers={**AUTH, "Content-Type": "application/json"}
            )
        else:
            response = httpx.post(served.url + path, json=body, headers=AUTH, timeout=TIMEOUT_S)
        assert response.status_code == status, (name, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert isinstance(error["message"], str) and error["message"], name
        assert error["type"] == "invalid_request_error", name
        if expected is not None:
            assert expected in (error["code"], error["param"]), (name, error)
        ok = httpx.post(
            f"{served.url}/v1/completions",
            json={"model": served.model, "prompt": "Hi", "max_tokens": 1},
            headers=AUTH,
            timeout=TIMEOUT_S,
        )
        assert ok.status_code == 200, (name, ok.text)
    wrong_method = httpx.get(f"{served.url}/v1/chat/completions", headers=AUTH)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    assert wait_idle(served)["kv_pages_in_use"] == 0
    served.check_integrity()


def test_client_disconnect_aborts_the_request_and_releases_its_pages(served: Served) -> None:
    baseline = wait_idle(served)
    assert baseline["kv_pages_in_use"] == 0
    body = {
        "model": served.model,
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 900,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(headers=AUTH, timeout=TIMEOUT_S) as client,
        client.stream("POST", f"{served.url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        content_chunks = 0
        while content_chunks < 3:
            line = next(lines)
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                content_chunks += 1
        during = served.stats()
        assert during["requests_running"] == 1 and during["kv_pages_in_use"] > 0
    # Leaving the block closed the connection mid-stream.
    after = wait_idle(served)
    assert after["kv_pages_in_use"] == baseline["kv_pages_in_use"]
    assert after["requests_aborted"] == baseline["requests_aborted"] + 1
    assert after["generated_tokens"] - baseline["generated_tokens"] < 900
    served.check_integrity()

    # A non-streamed request whose client gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{served.url}/v1/chat/completions",
            json={**body, "stream": False},
            headers=AUTH,
            timeout=httpx.Timeout(60, read=1.0),
        )
    final = wait_idle(served)
    assert final["kv_pages_in_use"] == baseline["kv_pages_in_use"]
    assert final["requests_aborted"] == baseline["requests_aborted"] + 2
    served.check_integrity()


def test_eight_agents_with_tools_and_consistent_metrics(served: Served) -> None:
    agents, turns = 8, 2
    before = scrape(served.url)
    usages: list[Any] = []

    async def agent(i: int, client: openai.AsyncOpenAI) -> None:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": f"Agent {i}: find the docs page about release {i}.0 and summarise it.",
            },
        ]
        for turn in range(turns):
            kwargs: dict[str, Any] = {
                "model": served.model,
                "messages": messages,
                "tools": TOOLS,
                "max_tokens": 8,
                "temperature": 0,
            }
            if i % 2:
                stream = await client.chat.completions.create(
                    **kwargs, stream=True, stream_options={"include_usage": True}
                )
                chunks = [c async for c in stream]
                text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                usage = chunks[-1].usage
            else:
                reply = await client.chat.completions.create(**kwargs)
                text, usage = reply.choices[0].message.content or "", reply.usage
            usages.append(usage)
            messages.append({"role": "assistant", "content": text})
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": f"call_{i}_{turn}",
                    "content": f"Release {i}.{turn} notes: fixed bugs.",
                }
            )

    samples: list[dict[tuple[str, tuple[tuple[str, str], ...]], float]] = []

    async def run() -> None:
        client = served.async_client()
        work = asyncio.gather(*(agent(i, client) for i in range(agents)))
        while not work.done():
            samples.append(await asyncio.to_thread(scrape, served.url))
            await asyncio.sleep(0.05)
        await work

    asyncio.run(run())
    wait_idle(served)
    after = scrape(served.url)
    n = agents * turns
    assert len(usages) == n

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    prompt = sum(u.prompt_tokens for u in usages)
    completion = sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert cached > 0  # the shared system prompt, and each agent's own earlier turn
    assert delta("swarmkv_prompt_tokens_total") == prompt
    assert delta("swarmkv_generation_tokens_total") == completion
    assert delta("swarmkv_requests_finished_total") == n
    assert delta("swarmkv_preemptions_total") == 0
    assert delta("swarmkv_prefix_hit_tokens_total") == cached  # one admission per request: no preemption
    # Every prompt token is either a hit or computed, and nothing was computed twice.
    assert delta("swarmkv_recomputed_tokens_total") == 0
    assert delta("swarmkv_prefill_tokens_computed_total") == prompt - cached
    assert delta("swarmkv_time_to_first_token_seconds_count") == n
    assert delta("swarmkv_inter_token_latency_seconds_count") == completion - n
    assert delta("swarmkv_http_requests_total", route="/v1/chat/completions", status="200") == n
    assert metric(after, "swarmkv_kv_pages_in_use") == 0
    assert metric(after, "swarmkv_requests_running") == metric(after, "swarmkv_requests_waiting") == 0
    assert metric(after, "swarmkv_kv_pages_total") == served.stats()["kv_pages_total"]
    for s in samples:
        assert metric(s, "swarmkv_kv_bytes_in_use") <= metric(s, "swarmkv_kv_bytes_logical")
    assert max(metric(s, "swarmkv_kv_bytes_reclaimed_by_sharing") for s in samples) > 0
    assert max(metric(s, "swarmkv_requests_running") for s in samples) > 1
    served.check_integrity()


def test_swarm_driver_reports_ttft_and_server_cached_tokens(served: Served) -> None:
    tokenizer = served.ctx.tokenizer
    workload = build_workload(
        tokenizer, agents=4, turns=2, prefix_tokens=300, max_tokens=6, tool_result_tokens=40
    )
    report = asyncio.run(run_swarm_over_http(served.url, workload, api_key=API_KEY))
    assert report["model"] == served.model
    turns = [t for agent in report["agent_turns"] for t in agent]
    assert len(turns) == 8 and report["summary"]["requests"] == 8
    assert all(t["ttft_s"] is not None and 0 < t["ttft_s"] <= t["latency_s"] for t in turns)
    assert all(t["completion_tokens"] and t["completion_tokens"] <= 6 for t in turns)
    head = prefix_token_count(tokenizer, workload.system_prompt, workload.tools) // 16 * 16
    assert all(t["cached_tokens"] >= head for t in turns if t["turn"] == 1)
    summary = report["summary"]
    assert summary["cached_tokens"] == sum(t["cached_tokens"] for t in turns)
    assert summary["ttft_p50_s"] <= summary["ttft_p95_s"]
    assert summary["output_tokens_per_s"] > 0
    assert wait_idle(served)["kv_pages_in_use"] == 0


def test_swarm_driver_per_slot_agents_share_no_page(served: Served) -> None:
    tokenizer = served.ctx.tokenizer
    workload = build_workload(
        tokenizer, agents=3, turns=2, prefix_tokens=300, max_tokens=4, tool_result_tokens=20, seed=11
    )
    report = asyncio.run(run_swarm_over_http(served.url, workload, api_key=API_KEY, per_slot=True))
    turns = [t for agent in report["agent_turns"] for t in agent]
    head = prefix_token_count(tokenizer, workload.system_prompt, workload.tools) // 16 * 16
    # First turns find nothing (each agent's salt is new), later turns find their own first turn.
    assert all(t["cached_tokens"] == 0 for t in turns if t["turn"] == 0)
    assert all(t["cached_tokens"] >= head for t in turns if t["turn"] == 1)
    assert wait_idle(served)["kv_pages_in_use"] == 0
