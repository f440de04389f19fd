"""A hybrid's later turn resumes at its previous prompt's end when the reply renders back differently.

Each turn's prompt end is snapshotted as its prefill finishes; the state pool keeps each conversation's newest
prompt end and turn end live, lets the ones the conversation moved past go first, then turn ends (a prompt end
serves the next turn however the reply renders back), then the least recently used. Greedy outputs of the tiny
float32 Qwen3.5 are the same with the snapshot as computed from scratch; slots and pages all come back.
"""

from __future__ import annotations

import random
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from swarmkv import LLM, SamplingParams
from swarmkv.engine.engine import LLMEngine
from swarmkv.kv.state_index import Snapshot, StateIndex
from swarmkv.models.loader import LoadedModel, load_model
from tiny_models import lengthen_recurrent_memory, make_tiny_checkpoint

VOCAB = 384  # prompt ids: byte-level ids of the Qwen tokenizer
LM_HEAD_VOCAB = 1024
BLOCK = 16
MAX_TOKENS = 8

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tokens(num_tokens: int, seed: int) -> list[int]:
    """Seeded random ids below VOCAB."""
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(num_tokens)]


def rendered_back(reply: list[int], seed: int) -> list[int]:
    """A reply as a chat template renders it back: other ids from the first on (random weights' text
    re-tokenizes differently; a thinking template drops the reasoning)."""
    other = tokens(len(reply) + 3, seed)
    if other[0] == reply[0]:
        other[0] = (other[0] + 1) % VOCAB
    return other


def greedy() -> SamplingParams:
    """Greedy sampling of exactly MAX_TOKENS tokens."""
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny Qwen3.5 (three Gated DeltaNet layers, one gated attention layer) in float32, its states
    decaying slowly so that a wrong state changes the outputs."""
    folder = tmp_path_factory.mktemp("prompt_snapshots") / "qwen3_5"
    make_tiny_checkpoint(folder, "qwen3_5", vocab_size=LM_HEAD_VOCAB)
    return load_model(lengthen_recurrent_memory(folder), dtype="float32")


def hybrid_llm(loaded: LoadedModel, **options: Any) -> LLM:
    """An engine over the tiny hybrid: an 8 MiB pool of 16-token pages unless `options` say otherwise."""
    return LLM(loaded=loaded, **{"kv_cache_memory": "8MiB", "block_size": BLOCK, **options})


def state_bytes(loaded: LoadedModel) -> int:
    """One state slot's bytes."""
    per: int = hybrid_llm(loaded).engine.stats()["state_bytes_per_sequence"]
    return per


def check_step(engine: LLMEngine) -> None:
    """Pages and state slots agree, and the prefill work adds up."""
    engine.check_integrity()
    stats = engine.stats()
    assert stats["prefill_tokens_computed"] == (
        stats["prompt_tokens"] - stats["prefix_hit_tokens"] + stats["recomputed_tokens"]
    )


def run(
    engine: LLMEngine, prompts: list[list[int]], after_step: Callable[[LLMEngine], None] = check_step
) -> list[tuple[list[int], int]]:
    """Submit `prompts` together, step until all finish; each one's output and cached prompt tokens."""
    sequences = []
    for prompt in prompts:
        request_id = uuid.uuid4().hex
        engine.add_request(request_id, prompt, greedy())
        sequence = engine.get_sequence(request_id)
        assert sequence is not None
        sequences.append(sequence)
    while engine.has_unfinished():
        engine.step()
        after_step(engine)
    return [(list(s.output_token_ids), s.num_cached_tokens) for s in sequences]


def reference(loaded: LoadedModel, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy outputs of an engine that shares nothing."""
    llm = hybrid_llm(loaded, prefix_caching=False, max_num_batched_tokens=4096)
    return [out.token_ids for out in llm.generate(prompts, greedy())]


def converse(
    engine: LLMEngine, agents: int, turns: int, head: list[int], seed: int
) -> tuple[list[list[list[int]]], list[list[int]], list[list[list[int]]]]:
    """`agents` conversations of `turns` turns, each turn's requests together: every turn's prompt is the
    previous prompt, its reply rendered back differently and a tool result. Prompts, cached tokens and
    outputs, by turn then agent."""
    prompts = [head + tokens(40 + 7 * a, seed + a) for a in range(agents)]
    all_prompts, cached, outputs = [], [], []
    for turn in range(turns):
        results = run(engine, prompts)
        all_prompts.append(prompts)
        outputs.append([out for out, _ in results])
        cached.append([hit for _, hit in results])
        prompts = [
            prompt + rendered_back(out, seed + 100 * turn + a) + tokens(30, seed + 1000 * turn + a)
            for a, (prompt, (out, _)) in enumerate(zip(prompts, results, strict=True))
        ]
    return all_prompts, cached, outputs


def kept(index: StateIndex, key: list[int]) -> Snapshot:
    """The snapshot after exactly `key` (no salt), which must be kept."""
    snapshot = index.snapshot(key, None)
    assert snapshot is not None, f"no snapshot after {len(key)} tokens"
    return snapshot


# The state pool's books.


def test_a_prompt_end_supersedes_what_its_conversation_moved_past() -> None:
    index, salt = StateIndex(8), None
    ids = tokens(200, seed=1)
    index.take("turn1")
    prompt1 = index.store(ids[:40], salt, "prompt", "turn1")
    turn1 = index.store(ids[:48], salt, "turn", "turn1")
    index.release("turn1")
    assert prompt1 is not None and turn1 is not None
    index.take("turn2", resumed=prompt1)  # the reply rendered back differently: the prompt end
    assert index.lineage("turn2") == kept(index, ids[:40]).lineage
    index.check({"turn2"})
    index.store(ids[:90], salt, "prompt", "turn2")

    assert kept(index, ids[:40]).superseded
    assert kept(index, ids[:48]).superseded
    assert not kept(index, ids[:90]).superseded
    assert index.counters.superseded == 2
    index.check({"turn2"})
    index.store(ids[:98], salt, "turn", "turn2")  # its turn end: the prompt end before it stays live
    assert not kept(index, ids[:90]).superseded
    index.release("turn2")
    index.check(set())


def test_snapshots_go_superseded_first_then_turn_ends_then_least_recently_used() -> None:
    index, salt = StateIndex(7), None
    ids = [tokens(120, seed=10 + a) for a in range(3)]
    index.take("a1")
    index.store(ids[0][:40], salt, "prompt", "a1")
    index.store(ids[0][:50], salt, "turn", "a1")
    index.release("a1")
    index.take("b1")
    index.store(ids[1][:40], salt, "prompt", "b1")
    index.store(ids[1][:50], salt, "turn", "b1")
    index.release("b1")
    branch = index.store(ids[2][:33], salt, "branch")  # the newest
    assert branch is not None
    index.take("a2", resumed=kept(index, ids[0][:40]).slot)
    index.store(ids[0][:80], salt, "prompt", "a2")  # supersedes a1's two; the pool is now full
    assert index.num_free == 0
    index.check({"a2"})

    # The superseded go first, then b1's turn end, then b1's prompt end: it is older than the branch.
    index.take("c")
    index.take("d")
    assert index.snapshot(ids[0][:40], salt) is None and index.snapshot(ids[0][:50], salt) is None
    assert index.snapshot(ids[1][:50], salt) is not None
    index.take("e")
    assert index.snapshot(ids[1][:50], salt) is None and index.snapshot(ids[1][:40], salt) is not None
    index.take("f")
    assert index.snapshot(ids[1][:40], salt) is None and index.snapshot(ids[2][:33], salt) is not None
    index.check({"a2", "c", "d", "e", "f"})


def test_a_fork_starts_its_own_lineage() -> None:
    index, salt = StateIndex(8), None
    ids = tokens(200, seed=3)
    index.take("r1")
    prompt = index.store(ids[:40], salt, "prompt", "r1")
    index.release("r1")
    assert prompt is not None
    index.take("left", resumed=prompt)
    index.take("right", resumed=prompt)  # the same conversation's prompt end, continued already
    assert index.lineage("left") != index.lineage("right")
    index.store(ids[:60], salt, "prompt", "left")
    index.store(ids[:40] + tokens(30, seed=4), salt, "prompt", "right")
    assert not kept(index, ids[:60]).superseded
    index.check({"left", "right"})


def test_a_pinned_snapshot_is_a_branch_nothing_supersedes() -> None:
    index, salt = StateIndex(6), None
    ids = tokens(200, seed=5)
    index.take("r1")
    index.store(ids[:40], salt, "prompt", "r1")
    slot = index.hold(ids[:40], salt)
    assert slot is not None
    index.store(ids[:64], salt, "prompt", "r1")
    held = index.snapshot(ids[:40], salt)
    assert held is not None and held.kind == "branch" and not held.superseded
    index.check({"r1"}, held=Counter({slot: 1}))


# The engine on the tiny Qwen3.5.


@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_a_later_turn_rendered_differently_resumes_at_the_previous_prompts_end(
    loaded: LoadedModel, async_scheduling: str
) -> None:
    llm = hybrid_llm(loaded, async_scheduling=async_scheduling)
    prompts, cached, outputs = converse(llm.engine, agents=1, turns=3, head=tokens(70, seed=20), seed=21)

    # Each later turn finds every token of the previous prompt, and nothing of the reply rendered back.
    assert [c[0] for c in cached[1:]] == [len(prompts[0][0]), len(prompts[1][0])]
    flat = [p for turn in prompts for p in turn]
    assert [o for turn in outputs for o in turn] == reference(loaded, flat)


def test_the_swarm_keeps_every_prompt_end_in_a_pool_with_no_room_for_turn_ends(loaded: LoadedModel) -> None:
    # Four running states, the four prompt ends and one more: only turn ends (and superseded prompt ends)
    # can make room. Least recently used alone would drop the prompt ends, the older of each turn's two.
    llm = hybrid_llm(loaded, state_memory=9 * state_bytes(loaded))
    assert llm.engine.stats()["state_slots_total"] == 9
    prompts, cached, outputs = converse(llm.engine, agents=4, turns=3, head=tokens(64, seed=30), seed=31)

    for turn in (1, 2):
        assert cached[turn] == [len(p) for p in prompts[turn - 1]]
    flat = [p for turn in prompts for p in turn]
    assert [o for turn in outputs for o in turn] == reference(loaded, flat)


def test_many_turns_and_evictions_leak_no_slot_or_page(loaded: LoadedModel) -> None:
    # Pools of 7 states and 24 pages: agents preempt each other, pages are evicted, snapshots dropped.
    per_state = state_bytes(loaded)
    page_bytes = hybrid_llm(loaded).engine.stats()["kv_bytes_per_token"] * BLOCK
    llm = hybrid_llm(
        loaded,
        kv_cache_memory=7 * per_state + 24 * page_bytes,
        state_memory=7 * per_state,
        max_num_batched_tokens=64,
    )
    engine = llm.engine
    converse(engine, agents=5, turns=4, head=tokens(48, seed=40), seed=41)
    converse(engine, agents=3, turns=3, head=tokens(48, seed=50), seed=51)

    stats = engine.stats()
    kv = engine.core.kv
    index = kv.states.index
    assert index is not None
    assert index.num_running == 0 and index.num_free + index.num_snapshots == index.num_slots
    assert stats["state_snapshot_drops"] > 0 and index.counters.superseded > 0
    assert stats["evictions"] > 0 and stats["preemptions"] > 0
    assert kv.num_in_use == 0 and kv.num_free + kv.num_cached == kv.num_pages
    kv.check_integrity()
