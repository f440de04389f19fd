"""Pins on a Qwen3.5 hybrid hold the recurrent-state snapshot at their prefix's end beside its pages, so a
request sharing a pinned prefix resumes there after traffic has dropped every unpinned state, and its output
equals a run that shares nothing (float32). A pin's pages and snapshot are let go when it is unpinned or its
TTL runs out; a pin of a prefix already cached with its state is held at once, with no prefill; pins never
hold the state pool's last two slots. The last test does it over HTTP: a Messages `cache_control` mark.
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmkv import LLM, SamplingParams
from swarmkv.engine.engine import LLMEngine
from swarmkv.errors import PinLimitError
from swarmkv.kv.state_index import StateIndex
from swarmkv.models.loader import LoadedModel, load_model
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer
from swarmkv.server.context import ServerContext
from tiny_models import lengthen_recurrent_memory, make_tiny_checkpoint

VOCAB = 384  # prompt ids: byte-level ids of the Qwen tokenizer
BLOCK = 16
NUM_PAGES = 24
NUM_SLOTS = 6
TIMEOUT_S = 600.0


# Tiny tensors run fastest on one thread on a shared CPU (conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3.5 whose states decay slowly, so a lost or wrong state changes the outputs."""
    folder = tmp_path_factory.mktemp("pins-hybrid") / "qwen3_5"
    make_tiny_checkpoint(folder, "qwen3_5", vocab_size=1024)
    return lengthen_recurrent_memory(folder)


@pytest.fixture(scope="module")
def loaded(folder: Path) -> LoadedModel:
    return load_model(folder, dtype="float32")


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def tokens(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(num_tokens)]


def small_llm(loaded: LoadedModel, **options: Any) -> LLM:
    """NUM_PAGES pages of BLOCK tokens and NUM_SLOTS state slots: a few requests evict and drop the rest."""
    probe = LLM(loaded=loaded, kv_cache_memory="8MiB", block_size=BLOCK).stats()
    page_bytes = probe["kv_bytes_per_token"] * BLOCK
    state_bytes = NUM_SLOTS * probe["state_bytes_per_sequence"]
    kv_bytes = NUM_PAGES * page_bytes + state_bytes
    options.setdefault("max_pinned_memory", kv_bytes - page_bytes)  # the state slots bound pins here
    llm = LLM(loaded=loaded, kv_cache_memory=kv_bytes, state_memory=state_bytes, block_size=BLOCK, **options)
    assert llm.stats()["kv_pages_total"] == NUM_PAGES
    return llm


def run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], int]:
    """One request stepped to its end, integrity checked after every step: its output and cached tokens."""
    request_id = uuid.uuid4().hex
    engine.add_request(request_id, prompt, params)
    seq = engine.get_sequence(request_id)
    assert seq is not None
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    return list(seq.output_token_ids), seq.num_cached_tokens


def traffic(engine: LLMEngine, seed: int) -> None:
    """Requests sharing nothing with anything else: together they outgrow the pool's pages and slots."""
    for i in range(8):
        run(engine, tokens(60, seed=seed + i), greedy(2))


def reference(loaded: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(loaded=loaded, kv_cache_memory="8MiB", block_size=BLOCK, prefix_caching=False)
    return [out.token_ids for out in llm.generate(prompts, greedy())]


def test_a_pinned_prefix_resumes_after_traffic_dropped_every_other_state(loaded: LoadedModel) -> None:
    llm = small_llm(loaded)
    engine = llm.engine
    head, unpinned_head = tokens(85, seed=1), tokens(85, seed=2)
    pin = llm.pin(head, ttl_s=600)
    pin_id = pin.pin_id
    assert pin.ready and pin.num_tokens == 80  # whole pages
    assert engine.core.kv.pinned_state(pin_id) is not None
    assert pin.kv_bytes == 5 * engine.stats()["kv_bytes_per_token"] * BLOCK + engine.core.pins.state_bytes
    run(engine, unpinned_head, greedy(1))  # the same, unpinned: traffic takes its pages and state

    traffic(engine, seed=100)

    prompts = [head + tokens(20, seed=3), unpinned_head + tokens(20, seed=4)]
    before = llm.stats()
    pinned_out, pinned_cached = run(engine, prompts[0], greedy())
    after = llm.stats()
    unpinned_out, unpinned_cached = run(engine, prompts[1], greedy())
    assert pinned_cached == 80, "the pinned prefix was not resumed from its pinned state"
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == len(prompts[0]) - 80
    assert unpinned_cached == 0, "the traffic should have dropped the unpinned prefix"
    assert [pinned_out, unpinned_out] == reference(loaded, prompts)

    assert llm.unpin(pin_id)
    assert engine.core.kv.num_pinned == 0 and engine.core.kv.states.index is not None
    assert engine.core.kv.states.index.num_held == 0 and engine.core.kv.num_pinned_states == 0
    assert llm.stats()["pinned_bytes"] == 0
    engine.check_integrity()
    traffic(engine, seed=200)  # the snapshot it held is dropped in its turn like any other
    _, cached = run(engine, head + tokens(20, seed=5), greedy(1))
    assert cached == 0
    engine.check_integrity()


def test_a_pin_of_a_prefix_cached_with_its_state_is_held_at_once(loaded: LoadedModel) -> None:
    llm = small_llm(loaded)
    engine = llm.engine
    head = tokens(70, seed=10)  # four whole pages and 6 tokens
    first = llm.pin(head)
    assert (first.num_tokens, first.num_created_tokens) == (64, 64)
    computed = llm.stats()["pin_prefill_tokens_computed"]
    assert computed == 64  # the whole pages alone, whose end the snapshot is at
    assert llm.unpin(first.pin_id)

    again = llm.pin(head)  # the pages and the snapshot are still cached: nothing is computed
    assert again.ready and (again.num_tokens, again.num_cached_tokens, again.num_created_tokens) == (
        64,
        64,
        0,
    )
    assert llm.stats()["pin_prefill_tokens_computed"] == computed
    assert engine.core.kv.pinned_state(again.pin_id) is not None
    twin = llm.pin(head)  # a second pin of the same prefix shares the pages and the snapshot
    assert engine.core.kv.pinned_state(twin.pin_id) == engine.core.kv.pinned_state(again.pin_id)
    assert engine.core.kv.num_pinned_states == 1 and engine.core.pins.held_bytes == again.kv_bytes
    engine.check_integrity()
    assert llm.unpin(again.pin_id) and llm.unpin(twin.pin_id)
    engine.check_integrity()


def test_an_expired_pin_lets_its_pages_and_state_go(loaded: LoadedModel) -> None:
    llm = small_llm(loaded)
    engine = llm.engine
    now = [0.0]
    engine.core.pins._clock = lambda: now[0]
    pin = llm.pin(tokens(48, seed=20), ttl_s=5.0)
    assert engine.core.kv.pinned_state(pin.pin_id) is not None and engine.core.kv.num_pinned == 3
    now[0] = 4.0
    assert engine.core.pins.expire() == []
    now[0] = 6.0
    assert engine.core.pins.expire() == [pin.pin_id]
    assert engine.core.kv.num_pinned == 0 and engine.core.kv.num_pinned_states == 0
    assert engine.get_pin(pin.pin_id) is None
    engine.check_integrity()


def test_pins_leave_the_state_pool_two_slots(loaded: LoadedModel) -> None:
    llm = small_llm(loaded)
    engine = llm.engine
    pins = [llm.pin(tokens(32, seed=30 + i)) for i in range(NUM_SLOTS - 2)]
    assert engine.core.kv.num_pinned_states == NUM_SLOTS - 2
    with pytest.raises(PinLimitError, match="state slot"):
        llm.pin(tokens(32, seed=40))
    # Requests still run, two at a time at most, and snapshots still serve them.
    prompt = tokens(40, seed=41)
    run(engine, prompt, greedy(1))
    _, cached = run(engine, prompt + tokens(10, seed=42), greedy(1))
    assert cached >= 32
    for pin in pins:
        assert llm.unpin(pin.pin_id)
    engine.check_integrity()


@settings(max_examples=200, deadline=None)
@given(
    num_slots=st.integers(2, 6),
    ops=st.lists(
        st.tuples(st.sampled_from(["take", "release", "store", "hold", "unhold"]), st.integers(0, 5))
    ),
)
def test_state_slots_keep_their_books_with_holds(num_slots: int, ops: list[tuple[str, int]]) -> None:
    """Requests, snapshots and pins' holds interleaved: a held snapshot is never dropped, holds leave two
    slots, and the books add up after every verb."""
    index = StateIndex(num_slots)
    running: set[str] = set()
    holds: list[int] = []
    held_keys: dict[int, tuple[int, ...]] = {}
    for op, arg in ops:
        key = tuple(range(arg + 1))
        if op == "take" and f"r{arg}" not in running and index.can_take():
            index.take(f"r{arg}")
            running.add(f"r{arg}")
        elif op == "release" and f"r{arg}" in running:
            index.release(f"r{arg}")
            running.discard(f"r{arg}")
        elif op == "store":
            index.store(key, None, "turn")
        elif op == "hold":
            slot = index.hold(key, None)
            if slot is not None:
                holds.append(slot)
                held_keys[slot] = key
        elif op == "unhold" and holds:
            index.unhold(holds.pop(arg % len(holds)))
        index.check(running, Counter(holds))
        assert index.num_held <= num_slots - 2
        assert all(index.has(held_keys[slot], None) for slot in holds), "a held snapshot was dropped"


# ---- over HTTP: a Messages cache_control mark on the hybrid ------------------------------------------


SYSTEM = " ".join(f"Rule {i}: keep every change small, tested and explained." for i in range(8))


def _message(system: str, text: str, mark: bool) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": system}
    if mark:
        block["cache_control"] = {"type": "ephemeral"}
    return {
        "model": "hybrid",
        "system": [block],
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 4,
        "temperature": 0,
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ServerContext]]:
    """The tiny hybrid with the whole Qwen3 vocabulary, whose chat template's special tokens it then has."""
    folder = tmp_path_factory.mktemp("pins-hybrid-chat") / "qwen3_5"
    loaded = load_model(lengthen_recurrent_memory(make_tiny_checkpoint(folder, "qwen3_5")), dtype="float32")
    app = create_app(small_llm(loaded, max_model_len=512), ServerConfig(served_model_name="hybrid"))
    with BackgroundServer(app) as server:
        ctx: ServerContext = app.state.ctx
        yield server.url, ctx
        ctx.engine.call(lambda engine: engine.check_integrity()).result(timeout=TIMEOUT_S)


def test_a_messages_mark_on_a_hybrid_spares_the_next_prefill(served: tuple[str, ServerContext]) -> None:
    url, ctx = served

    def post(body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(f"{url}/v1/messages", json=body, timeout=TIMEOUT_S)
        assert response.status_code == 200, response.text
        usage: dict[str, Any] = response.json()["usage"]
        return usage

    first = post(_message(SYSTEM, "Hello.", mark=True))
    assert first["cache_creation_input_tokens"] > 0
    for i in range(6):  # other system prompts: their states and pages push the first's out, unless pinned
        post(_message(f"Other {i}. {SYSTEM[::-1]}", f"Question {i}?", mark=False))
    second = post(_message(SYSTEM, "Goodbye.", mark=True))
    # The marked system turn was pinned with its state: read, and the pin refreshed at once.
    assert second["cache_read_input_tokens"] >= first["cache_creation_input_tokens"] - BLOCK
    assert second["cache_creation_input_tokens"] == 0
    held = ctx.engine.call(lambda engine: engine.core.kv.num_pinned_states).result(timeout=TIMEOUT_S)
    assert held == 1
