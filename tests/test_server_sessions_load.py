"""Reliability: 32 agent sessions over several turns on a KV pool for about 8, with a host-memory tier.

Seeded at random, agents stream or wait for their replies, abort streams, drop connections, pin prefixes
(some past the cap), unpin and release their sessions. No answer may be a 5xx; the engine's integrity
holds after every step and every state-changing call; afterwards, with every session released and every
pin gone, no page is held on either tier; and every turn that finished produced exactly what its prompt
produces alone on a fresh engine (greedy, float64).
"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Literal

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine_helpers import TINY_VOCAB, tiny_llm, tiny_loaded
from swarmkv import SamplingParams
from swarmkv.engine.engine import LLMEngine
from swarmkv.engine.llm import LLM
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext

SEED = 7
NUM_SESSIONS = 32
TURNS = 4
BLOCK = 16
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 8  # (K, V) x layers x KV heads x head dim x float64 bytes
PAGE_BYTES = BLOCK * KV_BYTES_PER_TOKEN
PAGES_PER_AGENT = 6  # a context grows from ~30 tokens by up to 16 a turn: 2 to 7 pages of 16
POOL_PAGES = 8 * PAGES_PER_AGENT
HOST_PAGES = 12 * PAGES_PER_AGENT
PIN_CAP_PAGES = 8
MAX_MODEL_LEN = 256

Mode = Literal["plain", "stream", "abort", "disconnect"]
MODES: tuple[Mode, ...] = ("plain", "stream", "abort", "disconnect")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """The tiny model's matmuls run far slower when BLAS threads of two engines contend for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class IntegrityWatch:
    """Runs `check_integrity()` after every step and every state-changing call, on the engine's own thread."""

    CHECKED = ("step", "add_request", "abort", "release_session", "add_pin", "unpin")

    def __init__(self, engine: LLMEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self.engine = engine
        self.num_checks = 0
        self.failures: list[str] = []
        for name in self.CHECKED:
            monkeypatch.setattr(engine, name, self._checked(name, getattr(engine, name)))

    def _checked(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def checked(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            finally:
                self.num_checks += 1
                try:
                    self.engine.check_integrity()
                except Exception:  # recorded, not raised: a raise would fail the loop and hide where
                    self.failures.append(f"after {name}: {traceback.format_exc()}")

        return checked


@cache
def _solo_llm() -> LLM:
    # Its own copy of the same weights (same seed): the reference never shares a module with the server's.
    return LLM(
        loaded=tiny_loaded.__wrapped__(0),
        kv_cache_memory=2 * MAX_MODEL_LEN * KV_BYTES_PER_TOKEN,
        block_size=BLOCK,
        prefix_caching=False,
        max_model_len=MAX_MODEL_LEN,
    )


_SOLO_LOCK = threading.Lock()


@cache
def solo(prompt: tuple[int, ...], max_tokens: int) -> tuple[list[int], str]:
    """The prompt's greedy reply when it runs alone on a fresh engine that shares nothing."""
    with _SOLO_LOCK:
        (out,) = _solo_llm().generate(
            [list(prompt)], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        )
    return out.token_ids, out.text


@dataclass
class Turn:
    session: str
    prompt: list[int]
    max_tokens: int
    mode: Mode
    text: str | None  # None: aborted or disconnected before the reply was read


@dataclass
class Swarm:
    """Agents over one HTTP client; records every status the server answered."""

    http: httpx.AsyncClient
    statuses: Counter[tuple[str, int]] = field(default_factory=Counter)
    turns: list[Turn] = field(default_factory=list)
    pins: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    metrics: str = ""

    def record(self, route: str, response: httpx.Response) -> httpx.Response:
        self.statuses[(route, response.status_code)] += 1
        if response.status_code >= 500:
            self.errors.append(f"{route}: {response.status_code} {response.text}")
        return response

    async def generate(
        self, rng: random.Random, session: str, prompt: list[int], max_tokens: int, mode: Mode
    ) -> str | None:
        body: dict[str, Any] = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        headers = {}
        if rng.random() < 0.5:
            body["session_id"] = session
        else:
            headers["X-Session-Id"] = session
        if mode in ("stream", "abort"):
            return await self._stream(body, headers, stop_early=mode == "abort")
        timeout = httpx.Timeout(120, read=rng.uniform(0.005, 0.1)) if mode == "disconnect" else None
        try:
            response = await self.http.post(
                "/v1/completions", json=body, headers=headers, **({"timeout": timeout} if timeout else {})
            )
        except httpx.ReadTimeout:
            return None  # the client gave up; the server must abort the request
        self.record("completions", response)
        return response.json()["choices"][0]["text"] if response.status_code == 200 else None

    async def _stream(self, body: dict[str, Any], headers: dict[str, str], stop_early: bool) -> str | None:
        pieces: list[str] = []
        async with self.http.stream(
            "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
        ) as response:
            self.record("completions", response)
            if response.status_code != 200:
                await response.aread()
                return None
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "".join(pieces)
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    self.errors.append(f"stream error: {event}")
                    return None
                pieces.append(event["choices"][0]["text"])
                if stop_early and pieces[-1]:
                    return None  # leaving the block closes the connection mid-stream
        return None

    async def pin(self, rng: random.Random, prompt: list[int]) -> None:
        over_cap = rng.random() < 0.2
        if over_cap:
            ids = [rng.randrange(TINY_VOCAB) for _ in range((PIN_CAP_PAGES + 1) * BLOCK)]
        else:
            ids = prompt[: rng.randint(1, len(prompt) // BLOCK) * BLOCK]
        body: dict[str, Any] = {"prompt_token_ids": ids, "ttl_s": rng.choice([None, 0.5, 3.0, 60.0])}
        response = self.record("pin", await self.http.post("/v1/cache/pin", json=body))
        if response.status_code == 200:
            assert not over_cap, "a pin past the cap was accepted"
            pin_id = response.json()["id"]
            if rng.random() < 0.5:
                self.record("unpin", await self.http.delete(f"/v1/cache/pin/{pin_id}"))
            else:
                self.pins.add(pin_id)
        else:
            assert response.status_code == 400, response.text
            assert response.json()["error"]["code"] == "pin_limit_exceeded", response.text

    async def release(self, session: str) -> int:
        return self.record("release", await self.http.post(f"/v1/sessions/{session}/release")).status_code

    async def agent(self, index: int) -> None:
        rng = random.Random(SEED * 1000 + index)
        session = f"agent-{index}"
        prompt = [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(20, 40))]
        for _ in range(TURNS):
            max_tokens = rng.randint(2, 24)
            mode = rng.choices(MODES, weights=(5, 3, 1, 1))[0]
            text = await self.generate(rng, session, prompt, max_tokens, mode)
            self.turns.append(Turn(session, prompt, max_tokens, mode, text))
            reply: list[int] = []
            if text is not None:
                reply, _ = await asyncio.to_thread(solo, tuple(prompt), max_tokens)
            # The agent's next turn: its context so far, its reply if it read one, and a tool result.
            prompt = prompt + reply + [rng.randrange(TINY_VOCAB) for _ in range(rng.randint(1, 8))]
            if rng.random() < 0.3:
                await self.pin(rng, prompt)
            if rng.random() < 0.2:
                status = await self.release(session)
                # After an abort the server may still be stopping the request; either answer is fine then.
                assert status == 200 or (status == 404 and text is None), status
        await self.release(session)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, ServerContext, IntegrityWatch]]:
    llm = tiny_llm(
        kv_cache_memory=POOL_PAGES * PAGE_BYTES,
        block_size=BLOCK,
        max_model_len=MAX_MODEL_LEN,
        retention="session",
        offload_memory=HOST_PAGES * PAGE_BYTES,
        max_pinned_memory=PIN_CAP_PAGES * PAGE_BYTES,
    )
    assert llm.stats()["kv_pages_total"] == POOL_PAGES
    watch = IntegrityWatch(llm.engine, monkeypatch)
    app = create_app(llm, ServerConfig(served_model_name="tiny"))
    with BackgroundServer(app) as server:
        yield server.url, app.state.ctx, watch


def test_32_sessions_with_pins_releases_and_aborts_on_a_pool_for_8(
    served: tuple[str, ServerContext, IntegrityWatch],
) -> None:
    url, ctx, watch = served
    peaks: Counter[str] = Counter()

    async def observe(done: asyncio.Event) -> None:
        while not done.is_set():
            stats = ctx.engine.stats()
            for key in ("requests_waiting", "requests_running", "pinned_bytes", "sessions_open"):
                peaks[key] = max(peaks[key], stats[key])
            await asyncio.sleep(0.02)

    async def run() -> Swarm:
        limits = httpx.Limits(max_connections=2 * NUM_SESSIONS)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
            swarm = Swarm(http)
            done = asyncio.Event()
            observer = asyncio.create_task(observe(done))
            try:
                await asyncio.gather(*(swarm.agent(i) for i in range(NUM_SESSIONS)))
            finally:
                done.set()
                await observer
            stats = await wait_idle(ctx)
            for pin_id in swarm.pins:  # those still held; the short-lived ones have expired (404)
                swarm.record("unpin", await http.delete(f"/v1/cache/pin/{pin_id}"))
            for i in range(NUM_SESSIONS):  # sessions a late abort left open
                await swarm.release(f"agent-{i}")
            swarm.metrics = swarm.record("metrics", await http.get("/metrics")).text
        assert stats["requests_running"] == stats["requests_waiting"] == 0
        return swarm

    swarm = asyncio.run(run())

    assert swarm.errors == [], swarm.errors[:3]
    assert all(status < 500 for (_, status) in swarm.statuses), swarm.statuses
    # Nor any answer nobody read (a dropped connection's): the server counts every status it sent.
    sent = [
        sample
        for family in text_string_to_metric_families(swarm.metrics)
        for sample in family.samples
        if sample.name == "swarmkv_http_requests_total"
    ]
    assert sent and not [s for s in sent if s.labels["status"].startswith("5")], sent
    assert watch.failures == [], watch.failures[0]
    assert watch.num_checks > 100
    stats = ctx.engine.call(lambda engine: engine.stats()).result(timeout=30)
    assert stats["kv_pages_in_use"] == 0, "a page is still held"
    assert stats["pins"] == 0 and stats["pinned_bytes"] == 0
    assert stats["sessions_open"] == 0 and stats["sessions_paused"] == 0
    ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=30)

    # The run was the one it meant to be: queueing, a host tier in use, pins refused at the cap.
    assert peaks["requests_waiting"] > 0 and peaks["sessions_open"] > 8
    assert 0 < peaks["pinned_bytes"] <= PIN_CAP_PAGES * PAGE_BYTES
    assert stats["offload_stores"] > 0
    assert stats["preemptions"] + stats["evictions"] > 0
    assert swarm.statuses[("pin", 200)] > 0 and swarm.statuses[("pin", 400)] > 0
    finished = [t for t in swarm.turns if t.text is not None]
    assert len(finished) >= NUM_SESSIONS * TURNS // 2
    assert any(t.text is None for t in swarm.turns if t.mode in ("abort", "disconnect"))

    for turn in finished:
        _, text = solo(tuple(turn.prompt), turn.max_tokens)
        assert turn.text == text, (turn.session, turn.mode, turn.prompt)


async def wait_idle(ctx: ServerContext, timeout_s: float = 30.0) -> dict[str, Any]:
    """The engine's stats once nothing runs or waits (aborts of dropped connections land a little later)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        stats = await asyncio.wrap_future(ctx.engine.call(lambda engine: engine.stats()))
        idle = stats["requests_running"] == 0 and stats["requests_waiting"] == 0
        if idle or asyncio.get_running_loop().time() > deadline:
            return stats
        await asyncio.sleep(0.05)
