"""Speculative decoding on a Qwen3.5 hybrid: a verification chunk keeps the state after each drafted position
and the slot is rewound to the last accepted one, so greedy output with speculation on is token-identical to
off, with drafts accepted, rejected and cut mid-draft, beside prefix sharing, a session's next turn, chunked
prefills and preemption; the states the prefix cache keeps are the ones decoding without drafts leaves.

The model is a tiny float64 Qwen3.5 whose states decay slowly (a state holding a rejected token would change
its outputs) with a 32-token vocabulary. Its drafts come from a sibling's reply: requests whose prompts are
the first's with one token changed and its reply's first tokens appended continue as the first did for a
while, then part from it (the positions below are where that happens late, early or never).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import swarmkv.resolve as resolve
from swarmkv import LLM, SamplingParams
from swarmkv.core.config import EngineConfig
from swarmkv.core.scheduler import Chunk
from swarmkv.core.sequence import Sequence
from swarmkv.engine.engine import LLMEngine
from swarmkv.models.loader import LoadedModel, load_model
from tiny_models import lengthen_recurrent_memory, make_tiny_checkpoint

VOCAB = 32
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
# Where a sibling's prompt differs from the first's: its reply then follows the first's for 2 to 40 tokens.
CHANGED_POSITIONS = (34, 36, 39, 40, 42, 47, 51, 55)
COPIED_TOKENS = 8

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny hybrid (three Gated DeltaNet layers, one attention layer) in float64."""
    folder = tmp_path_factory.mktemp("hybrid_spec") / "qwen3_5"
    make_tiny_checkpoint(folder, "qwen3_5", vocab_size=VOCAB)
    return load_model(lengthen_recurrent_memory(folder), dtype="float64")


def random_tokens(num_tokens: int, seed: int) -> list[int]:
    """Seeded random ids of the model's vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(num_tokens)]


class Verified:
    """Records every verification's (accepted draft tokens, draft tokens) of one engine, at the executor's
    verification seam."""

    def __init__(self, engine: LLMEngine) -> None:
        self.counts: list[tuple[int, int]] = []
        inner = engine.executor.verify

        def record(sampling: list[Chunk], *args: Any) -> dict[int, list[int]]:
            out = inner(sampling, *args)
            self.counts += [(len(tokens) - 1, len(sampling[i].draft)) for i, tokens in out.items()]
            return out

        engine.executor.verify = record  # type: ignore[method-assign]


def step_all(engine: LLMEngine, prompts: list[list[int]], **kw: Any) -> list[Sequence]:
    """Submit `prompts` together and step until all finish, checking the books after every step."""
    ids = [f"r{engine.core.num_arrivals}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, GREEDY, **kw)
    seqs = [engine.get_sequence(rid) for rid in ids]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    return [s for s in seqs if s is not None]


def workload(engine: LLMEngine) -> Iterator[list[int]]:
    """A first request, its siblings drafting from its reply, then a session's two turns: every reply."""
    first = random_tokens(80, seed=0)
    reply = step_all(engine, [first])[0].output_token_ids
    yield reply
    siblings = []
    for position in CHANGED_POSITIONS:
        prompt = list(first)
        prompt[position] = (prompt[position] + 1) % VOCAB
        siblings.append(prompt + reply[:COPIED_TOKENS])
    yield from (s.output_token_ids for s in step_all(engine, siblings))
    turn = random_tokens(60, seed=1)
    answer = step_all(engine, [turn], session_id="s")[0].output_token_ids
    yield answer
    # The next turn repeats the first's reply (a session draft source) and resumes from its state.
    (again,) = step_all(engine, [turn + answer + [3]], session_id="s")
    yield again.output_token_ids
    if engine.core.kv.prefix_caching:
        # The state after all but the reply's last token, left by a verification step.
        assert again.num_cached_tokens == len(turn) + len(answer) - 1


def hybrid_engine(loaded: LoadedModel, speculation: str, **options: Any) -> LLMEngine:
    """An engine over the tiny hybrid: a 4 MiB pool of 16-token pages unless `options` say otherwise; all
    eight siblings may draft in one step."""
    options = {"kv_cache_memory": "4MiB", "block_size": 16, "max_speculative_rows": 64, **options}
    return LLM(loaded=loaded, speculation=speculation, **options).engine


def preempting_options(loaded: LoadedModel) -> dict[str, Any]:
    """A pool of 24 pages of 8 tokens: the eight siblings (about 16 pages each at their end) cannot all run."""
    probe = hybrid_engine(loaded, "off", block_size=8)
    state_bytes = 6 * probe.core.state_bytes_per_sequence
    return {
        "block_size": 8,
        "kv_cache_memory": 24 * probe.kv_bytes_per_token * 8 + state_bytes,
        "state_memory": state_bytes,
    }


@pytest.mark.parametrize("case", ["shared", "per-slot", "chunked", "preempting"])
def test_greedy_output_is_identical_with_speculation_on(loaded: LoadedModel, case: str) -> None:
    options: dict[str, Any] = {
        "shared": {},
        "per-slot": {"prefix_caching": False},
        "chunked": {"max_num_batched_tokens": 24, "block_size": 4},
        "preempting": preempting_options(loaded) if case == "preempting" else {},
    }[case]
    off = list(workload(hybrid_engine(loaded, "off", **options)))
    engine = hybrid_engine(loaded, "on", **options)
    verified = Verified(engine)
    on = list(workload(engine))

    assert on == off
    stats = engine.snapshot()
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens > 0
    assert stats.generated_tokens == sum(len(o) for o in on)
    # Drafts wholly accepted, wholly rejected and cut after some of their tokens: each rewinds differently.
    assert any(0 < accepted < drafted for accepted, drafted in verified.counts)
    assert any(accepted == drafted > 1 for accepted, drafted in verified.counts)
    assert any(accepted == 0 for accepted, _ in verified.counts)
    if case == "preempting":
        assert stats.preemptions > 0
    kv = engine.core.kv
    assert kv.num_in_use == 0 and kv.num_free + kv.num_cached == kv.num_pages  # no page leaked
    assert kv.states.index is not None and kv.states.index.num_running == 0  # no state slot leaked


def test_kept_states_equal_those_decoding_without_drafts(loaded: LoadedModel) -> None:
    """A snapshot must never hold a rejected draft token: every state both engines keep for the same
    tokens (each reply's end, the branch points) is the same tensor, to float64 rounding."""
    engines = {mode: hybrid_engine(loaded, mode, kv_cache_memory="16MiB") for mode in ("off", "on")}
    outputs = {mode: list(workload(engine)) for mode, engine in engines.items()}
    assert outputs["on"] == outputs["off"]
    off_index, on_index = (engines[m].core.kv.states.index for m in ("off", "on"))
    assert off_index is not None and on_index is not None
    compared = 0
    for key, snapshot in on_index._snapshots.items():
        other = off_index._snapshots.get(key)
        if other is None:
            continue
        for tensor in ("conv", "ssm"):
            on_state = getattr(engines["on"].states, tensor)[:, snapshot.slot]
            off_state = getattr(engines["off"].states, tensor)[:, other.slot]
            torch.testing.assert_close(on_state, off_state, rtol=1e-9, atol=1e-12)
        compared += 1
    assert compared >= 4  # the replies' ends at least


def test_speculation_is_on_for_hybrids_on_either_backend() -> None:
    """auto and on verify drafts on every model and backend (the triton backend's recurrent kernels keep
    the state after each drafted position too: tests/test_triton_speculation_hybrid.py); off does not."""
    assert resolve.speculation(EngineConfig().speculation)
    assert resolve.speculation("on")
    assert not resolve.speculation("off")


def test_a_failed_verification_leaves_the_next_requests_exact(loaded: LoadedModel) -> None:
    """A step that fails after its forward keeps per-position states no verification rewound to: the next
    step drops them, and what follows is what an engine without drafts generates."""
    first = random_tokens(80, seed=0)
    engines = {mode: hybrid_engine(loaded, mode) for mode in ("off", "on")}
    replies = {mode: step_all(engine, [first])[0].output_token_ids for mode, engine in engines.items()}
    prompt = first + replies["off"][:COPIED_TOKENS]
    engine = engines["on"]
    inner = engine.executor.verify
    calls = {"n": 0}

    def fail_first(*args: Any) -> dict[int, list[int]]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("verification failed")
        return inner(*args)

    engine.executor.verify = fail_first  # type: ignore[method-assign]
    step_all(engine, [prompt])
    assert engine.snapshot().failed_steps == 1
    again = {mode: step_all(e, [prompt])[0].output_token_ids for mode, e in engines.items()}
    assert again["on"] == again["off"] and replies["on"] == replies["off"]
    assert engine.snapshot().spec_accepted_tokens > 0


def test_per_position_states_are_those_of_each_prefix() -> None:
    """A speculative chunk's kept state after row j is the state a prefill of its first j + 1 rows leaves,
    and its outputs are the prefill's."""
    from swarmkv.engine.recurrent_step import conv_positions, delta_rule_positions
    from swarmkv.models import gated_delta

    torch.manual_seed(0)
    n, channels, kernel, heads, key_heads, dim = 5, 6, 4, 4, 2, 8
    x, window, weight = (
        torch.randn(n, channels),
        torch.randn(channels, kernel - 1),
        torch.randn(channels, kernel),
    )
    out, windows = conv_positions(x, window, weight)
    torch.testing.assert_close(out, gated_delta.causal_conv(x, window, weight)[0])
    for j in range(n):
        torch.testing.assert_close(windows[j], gated_delta.causal_conv(x[: j + 1], window, weight)[1])
    q, k = torch.randn(n, key_heads, dim), torch.randn(n, key_heads, dim)
    v, g, beta = torch.randn(n, heads, dim), -torch.rand(n, heads), torch.rand(n, heads)
    state = torch.randn(heads, dim, dim)
    out, states = delta_rule_positions(q, k, v, g, beta, state)
    torch.testing.assert_close(out, gated_delta.gated_delta_chunked(q, k, v, g, beta, state)[0])
    for j in range(n):
        rows = slice(0, j + 1)
        prefix = gated_delta.gated_delta_chunked(q[rows], k[rows], v[rows], g[rows], beta[rows], state)[1]
        torch.testing.assert_close(states[j], prefix)
