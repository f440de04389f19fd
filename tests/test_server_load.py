"""Load: 64 concurrent streamed requests on a KV pool sized for about 8 of them.

Requests queue (and some get preempted and recomputed); every one must still finish with its full
reply, no answer may be a 5xx, and afterwards every page is back and the cache's integrity holds. The
default model runs in float32 here (weights and activations), so that a reply's tokens do not depend on
the batch it ran in: the int4 kernels' bfloat16 rounding does, differently on each CPU.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from swarmkv.core.sampling_params import SamplingParams
from swarmkv.engine.llm import LLM
from swarmkv.models.loader import load_model
from swarmkv.server import create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext

NUM_REQUESTS = 64
MAX_TOKENS = 16
BLOCK_SIZE = 16
PAGES_PER_REQUEST = 4  # on average: prompts of ~25 (completion) or ~55 (chat) tokens, plus 16 generated
POOL_TOKENS = 8 * PAGES_PER_REQUEST * BLOCK_SIZE

pytestmark = [pytest.mark.model, pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[str, ServerContext]]:
    loaded = load_model(dtype="float32", weights="float")
    kv_bytes = POOL_TOKENS * loaded.config.kv_bytes_per_token(loaded.dtype)
    llm = LLM(loaded=loaded, kv_cache_memory=kv_bytes, block_size=BLOCK_SIZE, max_model_len=POOL_TOKENS)
    assert llm.stats()["kv_pages_total"] == 8 * PAGES_PER_REQUEST
    app = create_app(llm)
    with BackgroundServer(app) as server:
        yield server.url, app.state.ctx


def _prompt(i: int) -> str:
    # The number comes first, so no two completion prompts share a page and chat prompts share only the
    # template's default system prompt (its first page or two): the pool pressure is real.
    return f"{i * 7919 % 10007} is request number {i}. Write a short poem about the number {i} and the sea."


def test_64_streams_on_a_pool_for_8(served: tuple[str, ServerContext]) -> None:
    url, ctx = served
    peaks = {"waiting": 0, "running": 0}

    async def one(client: openai.AsyncOpenAI, i: int) -> dict[str, Any]:
        common: dict[str, Any] = {
            "model": ctx.model_name,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "extra_body": {"ignore_eos": True},
        }
        if i % 2:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": _prompt(i)}], **common
            )
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            stream = await client.completions.create(prompt=_prompt(i), **common)
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        return {"text": text, "finish": finish, "usage": chunks[-1].usage, "num_chunks": len(chunks)}

    async def watch(done: asyncio.Event) -> None:
        while not done.is_set():
            stats = ctx.engine.stats()
            peaks["waiting"] = max(peaks["waiting"], stats["requests_waiting"])
            peaks["running"] = max(peaks["running"], stats["requests_running"])
            await asyncio.sleep(0.02)

    async def run() -> list[dict[str, Any]]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        done = asyncio.Event()
        watcher = asyncio.create_task(watch(done))
        try:
            # An APIStatusError (any 4xx or 5xx) would propagate out of gather and fail the test.
            return await asyncio.gather(*(one(client, i) for i in range(NUM_REQUESTS)))
        finally:
            done.set()
            await watcher

    results = asyncio.run(run())
    assert len(results) == NUM_REQUESTS
    for r in results:
        assert r["finish"] == ["length"]
        assert r["usage"].completion_tokens == MAX_TOKENS
        assert r["text"]
        assert r["num_chunks"] >= 3  # content arrived over several events, not in one piece
    # The pool held only some requests at once: the rest waited.
    assert peaks["waiting"] > 0 and peaks["running"] < NUM_REQUESTS
    stats = ctx.engine.call(lambda engine: engine.stats()).result(timeout=30)
    assert stats["kv_pages_in_use"] == 0
    assert stats["requests_running"] == stats["requests_waiting"] == 0
    assert stats["requests_finished"] == NUM_REQUESTS
    ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=30)

    # Streams that queued, were preempted and recomputed carry the same greedy tokens as a request run
    # alone on a fresh engine that shares nothing (float32: batch composition does not flip an argmax).
    loaded = ctx.engine.engine.loaded
    kv_bytes = POOL_TOKENS * loaded.config.kv_bytes_per_token(loaded.dtype)
    fresh = LLM(loaded=loaded, kv_cache_memory=kv_bytes, prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in (0, 9, 30, 63):
        prompt: Any = [{"role": "user", "content": _prompt(i)}] if i % 2 else _prompt(i)
        (solo,) = fresh.generate([prompt], params)
        assert solo.text == results[i]["text"], i
