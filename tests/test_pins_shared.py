"""Requests that pin the same prefix at the same moment share one pin: neither is refused, the later one
waits for the earlier one's prefill and reads the prefix from the cache, and the pin outlives the later TTL."""

from __future__ import annotations

import asyncio
from typing import Any

from engine_helpers import tiny_llm
from swarmkv.core.sampling_params import SamplingParams
from swarmkv.server.engine_loop.async_engine import AsyncEngine
from swarmkv.server.engine_loop.commands import RequestPin

HEAD = [(7 * i + 3) % 300 + 20 for i in range(64)]  # four 16-token pages
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


async def _run(engine: AsyncEngine, request_id: str, tail: list[int], pin: RequestPin) -> tuple[Any, int]:
    stream = await engine.submit(request_id, HEAD + tail, GREEDY, pins=(pin,))
    outputs = [out async for out in stream]
    return outputs[-1], stream.num_pin_created_tokens


def test_two_requests_pinning_one_prefix_at_once_share_the_pin() -> None:
    llm = tiny_llm(max_num_seqs=4, max_pinned_memory=8 * 2**20)
    engine = AsyncEngine(llm.engine)
    engine.start()
    try:
        pin_short = RequestPin("pin-msg-shared", HEAD, 300.0)
        pin_long = RequestPin("pin-msg-shared", HEAD, 3600.0)

        async def both() -> list[tuple[Any, int]]:
            return await asyncio.gather(
                _run(engine, "a", [1, 2, 3], pin_short), _run(engine, "b", [4, 5, 6], pin_long)
            )

        (last_a, created_a), (last_b, created_b) = asyncio.run(both())
        # One of them computed the head under the pin; the other created nothing, and both read it.
        assert sorted([created_a, created_b]) == [0, len(HEAD)]
        assert last_a.num_cached_tokens >= len(HEAD) and last_b.num_cached_tokens >= len(HEAD)
        info = engine.call(lambda e: e.get_pin("pin-msg-shared")).result(timeout=60)
        assert info is not None and info.ready and info.holders == 2
        assert info.num_tokens == len(HEAD)
        assert info.expires_in_s is not None and info.expires_in_s > 3000  # the later TTL won
        engine.call(lambda e: e.check_integrity()).result(timeout=60)
    finally:
        engine.shutdown()


def test_a_repeat_of_a_held_pin_shares_it_and_creates_nothing() -> None:
    llm = tiny_llm(max_num_seqs=4, max_pinned_memory=8 * 2**20)
    engine = AsyncEngine(llm.engine)
    engine.start()
    try:
        pin = RequestPin("pin-msg-repeat", HEAD, 60.0)
        _, created = asyncio.run(_run(engine, "first", [9], pin))
        assert created == len(HEAD)
        last, created = asyncio.run(_run(engine, "second", [8], pin))
        assert created == 0 and last.num_cached_tokens >= len(HEAD)
        info = engine.call(lambda e: e.get_pin("pin-msg-repeat")).result(timeout=60)
        assert info is not None and info.holders == 2
        engine.call(lambda e: e.check_integrity()).result(timeout=60)
    finally:
        engine.shutdown()
