"""Speculative decoding on a Qwen3.5 hybrid on the triton backend, interpreted on the CPU: a verification
chunk's recurrent kernels keep the state after each drafted position and the slot is rewound to the last
accepted one, so greedy output with speculation on is the torch backend's with speculation off (and on),
drafts accepted and rejected, beside decode steps replayed from (stand-in) graphs; the states the prefix
cache keeps are the ones decoding without drafts leaves. (Triton off against torch off is the subject of
tests/test_triton_hybrid.py: an interpreted run takes some 45 s here, so this module runs one.)

The model is the tiny float32 Qwen3.5 of tests/test_speculation_hybrid.py with its 32-token vocabulary; its
drafts come from a sibling's reply: requests under the first's head (its first 32 tokens) whose prompts are
the first's, or the first's with its last tokens changed, with its reply's first tokens appended.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine_helpers import FEWER_HYBRID_HEADS  # noqa: E402
from swarmkv import LLM, SamplingParams  # noqa: E402
from swarmkv.core.sequence import Sequence  # noqa: E402
from swarmkv.engine.cuda_graphs import DecodeGraphs, EagerGraph, batch_buckets  # noqa: E402
from swarmkv.engine.engine import LLMEngine  # noqa: E402
from swarmkv.models.loader import LoadedModel, load_model  # noqa: E402
from test_speculation_hybrid import VOCAB, Verified, random_tokens  # noqa: E402
from tiny_models import lengthen_recurrent_memory, make_tiny_checkpoint  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT_TOKENS = 34  # past the drafter's 32-token head, so that siblings share the first's
CHANGED_POSITIONS = (None, 32)  # a sibling's prompt is the first's, or the first's with this token changed
COPIED_TOKENS = 4
# The states of a snapshot against the torch backend's: the recurrent kernel's float32 rounding.
STATE_TOLERANCE = 1e-4 if DEVICE == "cpu" else 5e-3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny hybrid (three Gated DeltaNet layers, one attention layer) in float32."""
    folder = tmp_path_factory.mktemp("triton_spec") / "qwen3_5"
    # Half the heads of the tiny shape, at its ratios: half the programs the interpreter walks.
    make_tiny_checkpoint(folder, "qwen3_5", vocab_size=VOCAB, **FEWER_HYBRID_HEADS)
    return load_model(lengthen_recurrent_memory(folder), dtype="float32", device=DEVICE)


def _engine(loaded: LoadedModel, backend: str, speculation: str, **options: Any) -> LLMEngine:
    return LLM(
        loaded=loaded,
        attention_backend=backend,
        speculation=speculation,
        kv_cache_memory="4MiB",
        block_size=16,
        max_speculative_rows=64,
        **options,
    ).engine


def _step_all(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    """Submit `prompts` together and step until all finish, checking the books after every step: replies."""
    ids = [f"r{engine.core.num_arrivals}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, GREEDY)
    seqs = [engine.get_sequence(request_id) for request_id in ids]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    return [s.output_token_ids for s in seqs if isinstance(s, Sequence)]


def _workload(engine: LLMEngine) -> list[list[int]]:
    """The first request, then its siblings together, drafting from its reply: every reply."""
    first = random_tokens(PROMPT_TOKENS, seed=0)
    (reply,) = _step_all(engine, [first])
    siblings = []
    for position in CHANGED_POSITIONS:
        prompt = list(first)
        if position is not None:
            prompt[position] = (prompt[position] + 1) % VOCAB
        siblings.append(prompt + reply[:COPIED_TOKENS])
    return [reply, *_step_all(engine, siblings)]


@pytest.mark.slow
def test_triton_speculation_on_a_hybrid_is_the_torch_backends_greedy_output(loaded: LoadedModel) -> None:
    reference = _engine(loaded, "torch", "off")
    expected = _workload(reference)
    engine = _engine(loaded, "triton", "on")
    runner = engine.runner.triton
    assert runner is not None
    graphs = DecodeGraphs(batch_buckets(4), runner._graph_shape, runner.forward, runner.device, EagerGraph)
    runner.graphs = graphs
    verified = Verified(engine)

    got = _workload(engine)

    assert got == expected == _workload(_engine(loaded, "torch", "on"))
    stats = engine.snapshot()
    assert stats.spec_draft_tokens > stats.spec_accepted_tokens > 0
    # Drafts wholly accepted and wholly rejected: the slot is left as it is, or rewound to the last token.
    assert any(accepted == drafted > 1 for accepted, drafted in verified.counts)
    assert any(accepted == 0 for accepted, _ in verified.counts)
    assert graphs.replays > 0  # decode steps without a draft replayed; the verification steps ran eagerly
    kv = engine.core.kv
    assert kv.num_in_use == 0 and kv.num_free + kv.num_cached == kv.num_pages  # no page leaked
    assert kv.states.index is not None and kv.states.index.num_running == 0  # no state slot leaked
    assert engine.states is not None and not engine.states._positions  # every verification rewound
    _assert_same_snapshots(engine, reference)


def _assert_same_snapshots(engine: LLMEngine, reference: LLMEngine) -> None:
    """Every state both engines snapshot for the same tokens (each reply's end) is the reference's, to
    float32 rounding: no snapshot holds a rejected draft token."""
    index, reference_index = engine.core.kv.states.index, reference.core.kv.states.index
    assert index is not None and reference_index is not None
    assert engine.states is not None and reference.states is not None
    compared = 0
    for key, snapshot in index._snapshots.items():
        other = reference_index._snapshots.get(key)
        if other is None:
            continue
        torch.testing.assert_close(
            engine.states.conv[:, snapshot.slot],
            reference.states.conv[:, other.slot],
            rtol=STATE_TOLERANCE,
            atol=STATE_TOLERANCE,
        )
        torch.testing.assert_close(
            engine.states.ssm[:, snapshot.slot],
            reference.states.ssm[:, other.slot],
            rtol=STATE_TOLERANCE,
            atol=STATE_TOLERANCE,
        )
        compared += 1
    assert compared >= 3  # the replies' ends
