"""Qwen3.5 hybrids on the triton backend, interpreted on the CPU: the conv and delta-rule kernels against
their torch twins over the state slots, and the engine's greedy tokens and logits against the torch backend's
over chunked prefills, decodes, a prefix hit on a state snapshot and concurrent requests, eager and replayed
from (stand-in) graphs. fla's chunked prefill kernel runs only on a GPU: its autotuner times configurations,
and the interpreter has no driver to time them with."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine_helpers import FEWER_HYBRID_HEADS  # noqa: E402
from swarmkv import LLM, SamplingParams  # noqa: E402
from swarmkv.engine.backend import resolve_attention_backend  # noqa: E402
from swarmkv.engine.cuda_graphs import DecodeGraphs, EagerGraph, batch_buckets  # noqa: E402
from swarmkv.kernels import gated_delta as kernels  # noqa: E402
from swarmkv.models import gated_delta as reference  # noqa: E402
from swarmkv.models.loader import LoadedModel, load_model  # noqa: E402
from tiny_models import lengthen_recurrent_memory, make_tiny_checkpoint  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Sequences of a step: lengths, and their slots (-1: a graph's padding row, no state). Lengths 1 and 2 are
# shorter than the conv's window of 3.
LENGTHS = [5, 1, 1, 19, 2]
SLOTS = [3, 0, -1, 1, 4]
NUM_SLOTS = 6
# Logits against the torch backend's: the recurrent kernel's float32 rounding on the CPU; on a GPU, fla's
# chunked prefill takes float32 dots as tf32.
LOGITS_TOLERANCE = 1e-4 if DEVICE == "cpu" else 5e-3


def _layout() -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    starts = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int64)
    spans = [(s, n, slot) for s, n, slot in zip(starts.tolist(), LENGTHS, SLOTS, strict=False)]
    return starts.to(DEVICE), torch.tensor(SLOTS, device=DEVICE), spans


@pytest.mark.parametrize(
    "max_tokens", [1, 19, 40]
)  # one program per sequence, or its tokens spread over 2 or 3
def test_conv_kernel_matches_torch_and_updates_windows_in_place(max_tokens: int) -> None:
    torch.manual_seed(0)
    channels, kernel_size = 40, 4
    starts, slots, spans = _layout()
    num_tokens = sum(LENGTHS)
    x = torch.randn(num_tokens, channels + 8, device=DEVICE)[:, :channels]  # rows strided, as from a split
    weight = torch.randn(channels, kernel_size, device=DEVICE)
    windows = torch.randn(NUM_SLOTS, channels, kernel_size - 1, device=DEVICE)
    expected_windows, expected = windows.clone(), []
    for start, length, slot in spans:
        window = windows[slot] if slot >= 0 else windows.new_zeros(channels, kernel_size - 1)
        out, new_window = reference.causal_conv(x[start : start + length], window, weight)
        expected.append(out)
        if slot >= 0:
            expected_windows[slot] = new_window

    got = kernels.causal_conv(x, windows, weight, starts, slots, max_tokens)

    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(windows, expected_windows, rtol=0, atol=0)  # slot 2 and 5 untouched too


def _delta_inputs(num_tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    num_k_heads, num_v_heads, dk, dv = 2, 4, 16, 16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(DEVICE)

    q, k, v = (
        randn(num_tokens, num_k_heads, dk),
        randn(num_tokens, num_k_heads, dk),
        randn(num_tokens, num_v_heads, dv),
    )
    g = -torch.rand(num_tokens, num_v_heads, generator=generator).to(DEVICE)
    beta = torch.rand(num_tokens, num_v_heads, generator=generator).to(DEVICE)
    return q, k, v, g, beta


def _torch_delta(
    inputs: tuple[torch.Tensor, ...], states: torch.Tensor, spans: list[tuple[int, int, int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs and the new states of every slot, sequence by sequence through the torch chunked form."""
    q, k, v, g, beta = inputs
    expected_states, outputs = states.clone(), []
    for start, length, slot in spans:
        rows = slice(start, start + length)
        state = states[slot].clone() if slot >= 0 else torch.zeros_like(states[0])
        out, new_state = reference.gated_delta_chunked(
            q[rows], k[rows], v[rows], g[rows], beta[rows], state, chunk_size=8
        )
        outputs.append(out)
        if slot >= 0:
            expected_states[slot] = new_state
    return torch.cat(outputs), expected_states


def test_delta_rule_kernel_matches_torch_and_updates_states_in_place() -> None:
    starts, slots, spans = _layout()
    inputs = _delta_inputs(sum(LENGTHS))
    states = 0.1 * torch.randn(NUM_SLOTS, 4, 16, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    expected, expected_states = _torch_delta(inputs, states, spans)

    got = kernels.gated_delta_recurrent(*inputs, states, starts, slots)

    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, expected_states, rtol=1e-5, atol=1e-5)  # slots 2 and 5 untouched too


def test_conv_positions_are_the_windows_after_each_row_and_leave_the_slots() -> None:
    """A speculative chunk's kept windows: after row j of a sequence, the window a conv of its first j + 1
    rows leaves (lengths 1 and 2 shorter than the window; a padding sequence keeps nothing)."""
    torch.manual_seed(0)
    channels, kernel_size = 70, 4  # two channel blocks
    starts, slots, spans = _layout()
    x = torch.randn(sum(LENGTHS), channels + 8, device=DEVICE)[:, :channels]
    windows = torch.randn(NUM_SLOTS, channels, kernel_size - 1, device=DEVICE)
    before = windows.clone()

    kept = kernels.conv_positions(x, windows, starts, slots, sum(LENGTHS))

    weight = torch.randn(channels, kernel_size, device=DEVICE)
    for start, length, slot in spans:
        if slot < 0:
            continue
        for j in range(length):
            _, expected = reference.causal_conv(x[start : start + j + 1], windows[slot], weight)
            torch.testing.assert_close(kept[start + j], expected, rtol=0, atol=0)
    torch.testing.assert_close(windows, before, rtol=0, atol=0)


def test_delta_rule_kernel_keeps_the_state_after_each_row_of_a_range() -> None:
    """The rows kept (the last two sequences', as a step's speculative chunks follow its prefills) hold
    the state after each; the outputs and new states are those without keeping."""
    starts, slots, spans = _layout()
    inputs = _delta_inputs(sum(LENGTHS))
    states = 0.1 * torch.randn(NUM_SLOTS, 4, 16, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    expected, expected_states = _torch_delta(inputs, states, spans)
    kept_from = spans[3][0]
    kept = torch.full((sum(LENGTHS) - kept_from, 4, 16, 16), float("nan"), device=DEVICE)
    before = states.clone()

    got = kernels.gated_delta_recurrent(*inputs, states, starts, slots, kept=kept, kept_from=kept_from)

    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, expected_states, rtol=1e-5, atol=1e-5)
    q, k, v, g, beta = inputs
    for start, length, slot in spans[3:]:
        for j in range(length):
            rows = slice(start, start + j + 1)
            _, prefix = reference.gated_delta_chunked(
                q[rows], k[rows], v[rows], g[rows], beta[rows], before[slot].clone(), chunk_size=8
            )
            torch.testing.assert_close(kept[start + j - kept_from], prefix, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="fla's chunked kernel is autotuned: GPUs only")
def test_fla_chunked_prefill_matches_torch() -> None:
    lengths, prefill_slots = [70, 3, 129], [2, 0, 5]  # over fla's 64-token chunks
    starts_host = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    spans = list(zip(starts_host.tolist(), lengths, prefill_slots, strict=False))
    inputs = _delta_inputs(sum(lengths), seed=2)
    states = 0.1 * torch.randn(NUM_SLOTS, 4, 16, 16, device=DEVICE)
    expected, expected_states = _torch_delta(inputs, states, spans)

    got = kernels.chunked_gated_delta(
        *inputs, states, starts_host.to(DEVICE), starts_host, torch.tensor(prefill_slots, device=DEVICE)
    )

    # fla's chunked kernels take float32 dots as tf32 (10-bit mantissas) on NVIDIA GPUs.
    torch.testing.assert_close(got, expected, rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(states, expected_states, rtol=5e-3, atol=5e-3)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny Qwen3.5 (three Gated DeltaNet layers, one gated attention layer, hidden 64) in float32, its
    states decaying slowly so that a state lost or mixed up changes the outputs."""
    folder = tmp_path_factory.mktemp("hybrid") / "qwen3_5"
    # Half the heads of the tiny shape, at its ratios: half the programs the interpreter walks.
    make_tiny_checkpoint(folder, "qwen3_5", vocab_size=512, **FEWER_HYBRID_HEADS)
    return load_model(lengthen_recurrent_memory(folder), dtype="float32", device=DEVICE)


def _llm(loaded: LoadedModel, backend: str, **options: Any) -> LLM:
    return LLM(
        loaded=loaded,
        attention_backend=backend,
        kv_cache_memory="8MiB",
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=32,  # prompts arrive in chunks, beside other requests' decodes
        **options,
    )


@dataclass(frozen=True)
class Workload:
    """What `_workload` saw: each output's tokens, the next turns' cached prompt tokens, and every step's
    logits and chunk kinds."""

    tokens: list[list[int]]
    cached: list[int]
    step_logits: list[torch.Tensor]
    step_kinds: list[tuple[str, ...]]  # each chunk's kind, sorted


def _workload(llm: LLM) -> Workload:
    """Three requests over a 40-token head at once, a fourth arriving while they decode (its prefill chunks
    beside their decodes), then the three's next turns (hits on the state snapshots their first turns left):
    each output's tokens, the next turns' cached tokens, and every step's logits and chunk kinds."""
    step_logits: list[torch.Tensor] = []
    step_kinds: list[tuple[str, ...]] = []
    engine = llm.engine
    run: Callable[..., Any] = engine.runner.run

    def recording(plan: Any, *provisional: Any) -> Any:
        chunks, logits = run(plan, *provisional)
        step_logits.append(logits.cpu().clone())
        step_kinds.append(tuple(sorted(c.kind for c in plan.chunks)))
        return chunks, logits

    engine.runner.run = recording  # type: ignore[method-assign]
    head = [(7 * i + 3) % 300 for i in range(40)]
    prompts = {f"r{i}": head + [300 + i, 301, 302 + i] for i in range(3)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, GREEDY)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in prompts}
    while engine.has_unfinished():
        if "late" not in tokens and all(tokens[r] for r in prompts):  # all three decode next
            prompts["late"] = list(range(20, 65))
            engine.add_request("late", prompts["late"], GREEDY)
            tokens["late"] = []
        for delta in engine.step():
            tokens[delta.request_id].extend(delta.new_token_ids)
        engine.check_integrity()
    next_turns = llm.generate([prompts[f"r{i}"] + tokens[f"r{i}"] + [11, 12] for i in range(3)], GREEDY)
    engine.check_integrity()
    return Workload(
        [*tokens.values(), *(o.token_ids for o in next_turns)],
        [o.num_cached_tokens for o in next_turns],
        step_logits,
        step_kinds,
    )


@pytest.fixture(scope="module")
def torch_reference(loaded: LoadedModel) -> Workload:
    return _workload(_llm(loaded, "torch"))


def _assert_same(got: Workload, expected: Workload) -> None:
    assert got.tokens == expected.tokens
    assert got.cached == expected.cached
    assert (
        got.cached == [40 + 3 + GREEDY.max_tokens - 1] * 3
    )  # hits on the snapshots at the first turns' ends
    assert any(len(set(kinds)) == 2 for kinds in got.step_kinds)  # prefill chunks beside decodes in a step
    assert ("decode",) * 3 in got.step_kinds  # three decodes alone: a graph bucket of 4 with a padding row
    assert got.step_kinds == expected.step_kinds
    for step, (ours, theirs) in enumerate(zip(got.step_logits, expected.step_logits, strict=True)):
        torch.testing.assert_close(
            ours, theirs, rtol=LOGITS_TOLERANCE, atol=LOGITS_TOLERANCE, msg=f"step {step}"
        )


@pytest.fixture(scope="module")
def graphed(loaded: LoadedModel) -> tuple[Workload, DecodeGraphs, LLM]:
    """The workload on the triton backend, interpreted once for the module: decode-only steps padded to their
    bucket (3 requests run as 4: a row with no state slot) and replayed on the graph's static metadata, state
    slots included, from the stand-in graph (which runs the same kernels again at replay); the prefill and
    mixed steps eager."""
    llm = _llm(loaded, "triton")
    runner = llm.engine.runner.triton
    assert runner is not None
    graphs = DecodeGraphs(batch_buckets(4), runner._graph_shape, runner.forward, runner.device, EagerGraph)
    runner.graphs = graphs
    return _workload(llm), graphs, llm


@pytest.mark.slow
def test_triton_hybrid_matches_the_torch_backend(
    graphed: tuple[Workload, DecodeGraphs, LLM], torch_reference: Workload
) -> None:
    workload, _, llm = graphed
    assert llm.engine.attention_backend == "triton"
    _assert_same(workload, torch_reference)
    # A stuck model would hide a wrong state.
    assert all(len(set(tokens)) > 1 for tokens in torch_reference.tokens)


@pytest.mark.slow
def test_graph_replays_of_hybrid_decodes_match_the_torch_backend(
    graphed: tuple[Workload, DecodeGraphs, LLM], torch_reference: Workload
) -> None:
    """Decode-only steps padded to their bucket (3 requests run as 4: a row with no state slot) and replayed
    on the graph's static metadata, state slots included."""
    workload, graphs, _ = graphed
    _assert_same(workload, torch_reference)
    assert graphs.replays > 0 and 4 in graphs._captured


def test_a_hybrid_takes_the_triton_backend_as_a_dense_model_does(loaded: LoadedModel) -> None:
    """auto: triton on a GPU, torch elsewhere; triton where asked (on the CPU, under the interpreter)."""
    assert _llm(loaded, "auto").engine.attention_backend == ("triton" if DEVICE == "cuda" else "torch")
    assert resolve_attention_backend("auto", torch.device("cuda")) == "triton"
    runner = _llm(loaded, "triton").engine.runner.triton
    assert runner is not None and runner.states is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_of_hybrid_decodes_equal_eager_on_the_gpu(loaded: LoadedModel) -> None:
    eager = _workload(_llm(loaded, "triton", enforce_eager=True))
    llm = _llm(loaded, "triton")
    graphed = _workload(llm)
    runner = llm.engine.runner.triton
    assert runner is not None and runner.graphs is not None and runner.graphs.replays > 0
    assert (graphed.tokens, graphed.cached) == (eager.tokens, eager.cached)
