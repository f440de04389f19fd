"""Qwen3.5 hybrids in the engine: prefix hits resume from recurrent-state snapshots at any length, chunks,
swarms and preemptions change what is computed, never what is generated.

Every output is compared with a fresh engine that shares nothing (`prefix_caching=False`), itself checked
against transformers' greedy `generate`; the model runs in float64 so that no greedy choice hinges on
rounding. Tests that drive the engine themselves check its integrity (pages and state slots) every step.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from swarmkv import LLM, SamplingParams
from swarmkv.config import ModelConfig
from swarmkv.core.config import EngineConfig
from swarmkv.engine.engine import LLMEngine
from swarmkv.errors import CapacityError, UnsupportedModelError
from swarmkv.kv.state_index import MIN_SNAPSHOT_TOKENS
from swarmkv.models.loader import LoadedModel, load_model
from tiny_models import float64_throughout, lengthen_recurrent_memory, make_tiny_checkpoint

VOCAB = 384  # prompt ids: byte-level ids of the Qwen tokenizer, every one decodes
LM_HEAD_VOCAB = 1024  # the model's vocabulary: generated ids decode too
BLOCK = 16
MAX_TOKENS = 8


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    """Greedy sampling of exactly `max_tokens` tokens."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def random_tokens(num_tokens: int, seed: int) -> list[int]:
    """Seeded random ids below VOCAB."""
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(num_tokens)]


def diverging(head: list[int], full: list[int], num_tokens: int, seed: int) -> list[int]:
    """`head` then `num_tokens` random ids whose first differs from what `full` has after `head`."""
    tail = random_tokens(num_tokens, seed)
    if len(full) > len(head) and tail[0] == full[len(head)]:
        tail[0] = (tail[0] + 1) % VOCAB
    return head + tail


# Tiny tensors run fastest on one thread on a shared CPU (conftest.py).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass(frozen=True)
class Finished:
    """What one request produced, and how much of its prompt the prefix cache served."""

    token_ids: list[int]
    num_cached_tokens: int


def run(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    after_step: Callable[[LLMEngine], None] | None = None,
) -> list[Finished]:
    """Submit `prompts` together and step until all finish, checking integrity after every step."""
    sequences = []
    for prompt in prompts:
        request_id = uuid.uuid4().hex
        engine.add_request(request_id, prompt, params)
        sequence = engine.get_sequence(request_id)
        assert sequence is not None
        sequences.append(sequence)
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        if after_step is not None:
            after_step(engine)
    return [Finished(list(s.output_token_ids), s.num_cached_tokens) for s in sequences]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3.5 checkpoint (three Gated DeltaNet layers, one gated attention layer), its states
    decaying slowly so that a state lost or mixed up changes the outputs. Its vocabulary is the tokenizer's
    first ids: an LM head over all 151k would be most of every float64 step's work."""
    folder = tmp_path_factory.mktemp("hybrid") / "qwen3_5"
    make_tiny_checkpoint(folder, "qwen3_5", vocab_size=LM_HEAD_VOCAB)
    return lengthen_recurrent_memory(folder)


@pytest.fixture(scope="module")
def loaded(folder: Path) -> LoadedModel:
    """The checkpoint loaded once in float64; each test's engines share it."""
    return load_model(folder, dtype="float64")


def hybrid_llm(loaded: LoadedModel, **options: Any) -> LLM:
    """An engine over the tiny hybrid: an 8 MiB pool of 16-token pages unless `options` say otherwise."""
    options = {"kv_cache_memory": "8MiB", "block_size": BLOCK, **options}
    return LLM(loaded=loaded, **options)


def reference(loaded: LoadedModel, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Greedy outputs of a fresh engine that shares nothing, all prompts in one batch."""
    llm = hybrid_llm(loaded, prefix_caching=False, max_num_batched_tokens=4096)
    return [out.token_ids for out in llm.generate(prompts, greedy(max_tokens))]


def hf_generate(folder: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy `generate` in float64 (float32 casts lifted), one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    outputs = []
    with torch.inference_mode(), float64_throughout(model):
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
            )
            outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


def test_greedy_matches_transformers_generate(folder: Path) -> None:
    prompts = [random_tokens(1, seed=1), random_tokens(37, seed=2), random_tokens(100, seed=3)]
    llm = LLM(model=str(folder), dtype="float64", kv_cache_memory="8MiB", block_size=BLOCK)

    outputs = llm.generate(prompts, greedy())

    assert [o.token_ids for o in outputs] == hf_generate(folder, prompts, MAX_TOKENS)
    assert all(len(set(o.token_ids)) > 1 for o in outputs)  # a stuck model would hide a wrong state
    llm.engine.check_integrity()


def test_prefix_hits_at_any_length_match_the_reference(loaded: LoadedModel) -> None:
    """Shares of P that end inside a page, between pages, on a page boundary and one token short of P."""
    prompt = random_tokens(150, seed=10)
    lengths = [5, 40, 61, 64, 149]
    first_wave = [diverging(prompt[:n], prompt, 12, seed=20 + n) for n in lengths]
    second_wave = [diverging(prompt[:n], prompt, 12, seed=40 + n) for n in lengths]
    llm = hybrid_llm(loaded)
    engine = llm.engine

    (first,) = run(engine, [prompt], greedy())
    firsts = [run(engine, [p], greedy())[0] for p in first_wave]
    # The first wave left P at each length; a state snapshot there serves the second wave.
    seconds = [run(engine, [p], greedy())[0] for p in second_wave]
    next_turn = prompt + first.token_ids + random_tokens(20, seed=60)
    (resumed,) = run(engine, [next_turn], greedy())

    expected = reference(loaded, [prompt, *first_wave, *second_wave, next_turn])
    got = [first, *firsts, *seconds, resumed]
    for i, (finished, want) in enumerate(zip(got, expected, strict=True)):
        assert finished.token_ids == want, f"request {i} diverged from the reference"
    for n, finished in zip(lengths, seconds, strict=True):
        if n >= MIN_SNAPSHOT_TOKENS:
            assert finished.num_cached_tokens == n, f"the share of {n} tokens was not a hit"
    # The next agent turn resumes from the state the first turn left at its end.
    assert resumed.num_cached_tokens >= len(prompt)
    stats = llm.stats()
    assert stats["prefix_hit_tokens"] >= len(prompt) + sum(n for n in lengths if n >= MIN_SNAPSHOT_TOKENS)
    assert stats["state_bytes_in_use"] == 0


def test_a_61_token_head_is_resumed_by_the_third_request(loaded: LoadedModel) -> None:
    """The second request diverges from the first at 61 tokens: where a snapshot is taken for the third."""
    head = random_tokens(61, seed=70)
    prompts = [head + random_tokens(20, seed=71 + i) for i in range(3)]
    engine = hybrid_llm(loaded).engine

    outputs = [run(engine, [p], greedy())[0] for p in prompts]

    assert [o.token_ids for o in outputs] == reference(loaded, prompts)
    assert outputs[2].num_cached_tokens >= len(head)


def test_cold_swarm_computes_the_shared_head_once(loaded: LoadedModel) -> None:
    head_len, tail_len, n = 100, 20, 6
    head = random_tokens(head_len, seed=80)
    prompts = [head + random_tokens(tail_len, seed=81 + i) for i in range(n)]
    llm = hybrid_llm(loaded)

    outputs = run(llm.engine, prompts, greedy(6))

    assert [o.token_ids for o in outputs] == reference(loaded, prompts, 6)
    stats = llm.stats()
    assert stats["prefill_tokens_computed"] <= head_len + n * tail_len + n * BLOCK
    assert stats["prefix_hit_tokens"] >= (n - 1) * (head_len - BLOCK)
    assert stats["prefill_tokens_computed"] == (
        stats["prompt_tokens"] - stats["prefix_hit_tokens"] + stats["recomputed_tokens"]
    )


@pytest.mark.parametrize(("budget", "prefix_caching"), [(7, True), (7, False), (1, True)])
def test_tiny_chunks_match_the_reference(loaded: LoadedModel, budget: int, prefix_caching: bool) -> None:
    """Prefills cut into chunks of a few tokens carry the conv window and the state across every cut."""
    head = random_tokens(40, seed=90)
    prompts = [
        head + random_tokens(9, seed=91),
        head + random_tokens(23, seed=92),
        random_tokens(30, seed=93),
    ]
    engine = hybrid_llm(loaded, prefix_caching=prefix_caching, max_num_batched_tokens=budget).engine

    outputs = run(engine, prompts, greedy(6))

    assert [o.token_ids for o in outputs] == reference(loaded, prompts, 6)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_matches_the_reference(loaded: LoadedModel, prefix_caching: bool) -> None:
    """Three requests whose replies outgrow a 6-page pool together: some are preempted and resumed."""
    probe = hybrid_llm(loaded).stats()
    page_bytes = probe["kv_bytes_per_token"] * probe["block_size"]
    state_bytes = 6 * probe["state_bytes_per_sequence"]  # three running, three snapshots
    prompts = [random_tokens(20, seed=100 + i) for i in range(3)]  # 2 pages each; with the reply, 3
    llm = hybrid_llm(
        loaded,
        prefix_caching=prefix_caching,
        kv_cache_memory=6 * page_bytes + state_bytes,
        state_memory=state_bytes,
    )
    assert llm.stats()["kv_pages_total"] == 6

    outputs = run(llm.engine, prompts, greedy(24))

    assert llm.stats()["preemptions"] > 0
    assert [o.token_ids for o in outputs] == reference(loaded, prompts, 24)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_state_stats_are_consistent(loaded: LoadedModel, prefix_caching: bool) -> None:
    head = random_tokens(50, seed=110)
    prompts = [head + random_tokens(10, seed=111 + i) for i in range(3)]
    llm = hybrid_llm(loaded, prefix_caching=prefix_caching, max_num_batched_tokens=32)
    per_sequence = llm.stats()["state_bytes_per_sequence"]
    seen_in_use: list[int] = []

    def check(engine: LLMEngine) -> None:
        stats = engine.stats()
        running = stats["requests_running"]
        assert stats["state_bytes_in_use"] == running * per_sequence
        assert stats["state_snapshot_bytes"] == stats["state_snapshots"] * per_sequence
        assert running + stats["state_snapshots"] <= stats["state_slots_total"]
        assert stats["state_bytes_total"] == stats["state_slots_total"] * per_sequence
        if not prefix_caching:
            assert stats["state_snapshots"] == 0  # nothing is shared, so no state is kept
        seen_in_use.append(stats["state_bytes_in_use"])

    run(llm.engine, prompts, greedy(), after_step=check)

    assert per_sequence == loaded.config.state_bytes_per_sequence(torch.float64) > 0
    assert max(seen_in_use) > 0
    stats = llm.stats()
    assert stats["state_bytes_in_use"] == 0
    if prefix_caching:
        assert stats["state_snapshots"] > 0  # each finished request's state at its end, at least
    # States and pages share the one pool.
    kv_bytes = stats["kv_pages_total"] * stats["kv_bytes_per_token"] * BLOCK
    assert stats["state_bytes_total"] + kv_bytes <= llm.engine.config.kv_cache_bytes


def test_a_state_pool_under_two_states_is_refused(loaded: LoadedModel) -> None:
    per_state = hybrid_llm(loaded).engine.stats()["state_bytes_per_sequence"]
    with pytest.raises(CapacityError, match="at least 2"):
        hybrid_llm(loaded, state_memory=per_state + 1)


def test_state_memory_must_leave_room_for_pages() -> None:
    with pytest.raises(ValueError, match="state_memory"):
        EngineConfig(kv_cache_memory="8MiB", state_memory="8MiB")


def test_a_qwen35moe_gguf_is_refused_with_the_reason() -> None:
    with pytest.raises(UnsupportedModelError, match="mixture-of-experts"):
        ModelConfig.from_gguf_metadata({"general.architecture": "qwen35moe"})
