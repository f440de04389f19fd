"""The triton attention backend end to end, interpreted on the CPU: the same greedy tokens as the torch
backend, graph replays equal to eager steps, and clear errors where triton cannot run."""

from __future__ import annotations

import argparse
import functools
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from engine_helpers import FEWER_HEADS  # noqa: E402
from swarmkv.core.sampling_params import SamplingParams  # noqa: E402
from swarmkv.engine.backend import resolve_attention_backend  # noqa: E402
from swarmkv.engine.cuda_graphs import DecodeGraphs, EagerGraph, batch_buckets  # noqa: E402
from swarmkv.engine.llm import LLM  # noqa: E402
from swarmkv.engine.triton_attention import TritonShape  # noqa: E402
from swarmkv.engine.triton_runner import MIXED_TOKEN_BUCKETS  # noqa: E402
from swarmkv.errors import ConfigError  # noqa: E402
from swarmkv.options import add_engine_arguments, engine_kwargs  # noqa: E402
from tiny_models import make_tiny_checkpoint  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3")
    make_tiny_checkpoint(folder, "qwen3", **FEWER_HEADS)  # half the interpreter's programs
    return folder


def _prompts() -> list[list[int]]:
    shared = list(range(100, 126))  # 26 tokens: over 6 pages of 4, a partial last page
    return [shared + [7, 8, 9 + i] for i in range(3)] + [[5, 6, 7, 8, 9]]


def _two_turns(llm: LLM) -> tuple[list[list[int]], dict[str, int]]:
    """A shared-prefix batch, then each prompt continued with its own output (prefix hits on both)."""
    prompts = _prompts()
    first = llm.generate(prompts, GREEDY)
    second = llm.generate([p + o.token_ids + [11] for p, o in zip(prompts, first, strict=True)], GREEDY)
    llm.engine.check_integrity()
    return [o.token_ids for o in first + second], llm.stats()


def _llm(tiny: Path, backend: str, **options: object) -> LLM:
    return LLM(
        str(tiny),
        dtype="float32",
        device=DEVICE,
        attention_backend=backend,
        max_num_batched_tokens=32,  # prompts arrive in chunks over cached prefixes
        block_size=4,
        cascade_attention="on",
        # 16,384 tokens, plenty for these workloads: the default 1 GiB pool held two million tokens of the
        # tiny model, and zeroing and indexing its pages cost several seconds an engine.
        kv_cache_memory="8MiB",
        **options,
    )


@pytest.fixture(scope="module")
def torch_reference(tiny: Path) -> tuple[list[list[int]], dict[str, int]]:
    return _two_turns(_llm(tiny, "torch"))


@pytest.fixture(scope="module")
def graphed(tiny: Path) -> tuple[list[list[int]], dict[str, int], DecodeGraphs, LLM]:
    """The two-turn workload on the triton backend, interpreted once for the module: decode-only steps
    padded to their bucket (3 requests run as 4) and replayed from the stand-in graph (which runs the same
    kernels again at replay), the other steps eager."""
    llm = _llm(tiny, "triton")
    runner = llm.engine.runner.triton
    assert runner is not None
    graphs = DecodeGraphs(batch_buckets(4), runner._graph_shape, runner.forward, runner.device, EagerGraph)
    runner.graphs = graphs
    tokens, stats = _two_turns(llm)
    return tokens, stats, graphs, llm


@pytest.mark.slow
def test_triton_generates_the_torch_backends_greedy_tokens(
    graphed: tuple[list[list[int]], dict[str, int], DecodeGraphs, LLM],
    torch_reference: tuple[list[list[int]], dict[str, int]],
) -> None:
    tokens, stats, _, llm = graphed
    assert llm.engine.attention_backend == "triton"
    expected, expected_stats = torch_reference
    assert tokens == expected
    assert stats["cascade_decode_rows"] > 0  # the shared-prefix kernel ran
    assert stats["prefix_hit_tokens"] == expected_stats["prefix_hit_tokens"] > 0


@pytest.mark.slow
def test_graph_replays_equal_eager_steps(
    graphed: tuple[list[list[int]], dict[str, int], DecodeGraphs, LLM],
    torch_reference: tuple[list[list[int]], dict[str, int]],
) -> None:
    """Decode-only steps padded to their bucket (3 requests run as 4) and replayed."""
    tokens, _, graphs, _ = graphed
    assert graphs.replays > 0
    assert 4 in graphs._captured and set(graphs._captured) <= set(batch_buckets(4))
    assert tokens == torch_reference[0]


def _prefill_beside_a_decode_group(llm: LLM) -> tuple[dict[str, list[int]], bool]:
    """Three requests sharing a head decode as one cascade group while a fourth arrives and prefills: each
    request's tokens, and whether a step ran the group beside a prefill."""
    engine = llm.engine
    shared = list(range(100, 126))
    for i in range(3):
        engine.add_request(f"d{i}", shared + [7, 8, 9 + i], GREEDY)
    tokens: dict[str, list[int]] = {}
    mixed = False
    while engine.has_unfinished():
        if "late" not in tokens and all(tokens.get(f"d{i}") for i in range(3)):  # all three decode next
            engine.add_request("late", list(range(200, 230)), GREEDY)
            tokens["late"] = []
            rows = engine.counters.cascade_decode_rows
            prefilled = engine.counters.prefill_tokens_computed
            for delta in engine.step():
                tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            mixed = (
                engine.counters.cascade_decode_rows > rows
                and engine.counters.prefill_tokens_computed > prefilled
            )
            continue
        for delta in engine.step():
            tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    engine.check_integrity()
    return tokens, mixed


@pytest.fixture(scope="module")
def beside_expected(tiny: Path) -> dict[str, list[int]]:
    """The torch backend's tokens for `_prefill_beside_a_decode_group`."""
    return _prefill_beside_a_decode_group(_llm(tiny, "torch"))[0]


@pytest.mark.slow
def test_a_prefill_beside_a_decode_group_generates_the_torch_backends_tokens(
    tiny: Path, beside_expected: dict[str, list[int]]
) -> None:
    """The group's page-table row is its first decode's chunk, after the prefills' chunks (not their tokens)."""
    tokens, mixed = _prefill_beside_a_decode_group(_llm(tiny, "triton", enforce_eager=True))
    assert mixed and tokens == beside_expected


def _stand_in_graphs(llm: LLM) -> tuple[DecodeGraphs, dict[int, DecodeGraphs]]:
    """Decode and mixed-step graphs of up to 4 decodes on the stand-in that recomputes on replay."""
    runner = llm.engine.runner.triton
    assert runner is not None
    runner.graphs = DecodeGraphs(
        batch_buckets(4), runner._graph_shape, runner.forward, runner.device, EagerGraph
    )
    runner.mixed_graphs = {
        tokens: DecodeGraphs(
            batch_buckets(4),
            functools.partial(runner._mixed_shape, tokens),
            runner.forward,
            runner.device,
            EagerGraph,
        )
        for tokens in MIXED_TOKEN_BUCKETS
    }
    return runner.graphs, runner.mixed_graphs


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", ["off", "on"])
def test_mixed_step_graphs_replay_prefills_beside_a_decode_group(
    tiny: Path, async_scheduling: str, beside_expected: dict[str, list[int]]
) -> None:
    """A prefill chunk beside a cascade group's decodes, replayed from a mixed graph (padded between the
    prefill rows and the decodes to its bucket's layout): the torch backend's tokens, with and without async
    scheduling (whose provisional inputs land after the gap)."""
    expected = beside_expected
    llm = _llm(tiny, "triton", mixed_step_graphs=True, async_scheduling=async_scheduling)
    decode_graphs, mixed_graphs = _stand_in_graphs(llm)
    tokens, mixed = _prefill_beside_a_decode_group(llm)
    assert mixed and tokens == expected
    assert sum(g.replays for g in mixed_graphs.values()) > 0 and decode_graphs.replays > 0
    assert (llm.engine.counters.lookahead_steps > 0) == (async_scheduling == "on")


def test_triton_off_the_gpu_needs_the_interpreter(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        resolve_attention_backend("triton", torch.device("cpu"))
    assert resolve_attention_backend("auto", torch.device("cpu")) == "torch"


def test_backend_flags_reach_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--attention-backend", "triton", "--enforce-eager"])
    kwargs = engine_kwargs(args)
    assert (kwargs["attention_backend"], kwargs["enforce_eager"]) == ("triton", True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "cuda"])
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(attention_backend="flash")


def test_buckets_cover_every_batch_up_to_the_limit() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_equal_eager_on_the_gpu(tiny: Path) -> None:
    eager, _ = _two_turns(_llm(tiny, "triton", enforce_eager=True))
    llm = _llm(tiny, "triton")
    graphed, _ = _two_turns(llm)
    runner = llm.engine.runner.triton
    assert runner is not None and runner.graphs is not None and runner.graphs.replays > 0
    assert graphed == eager


def test_a_bucket_whose_capture_fails_runs_eagerly() -> None:
    class BrokenGraph:
        def capture(self, compute: object) -> torch.Tensor:
            raise RuntimeError("out of memory while capturing")

        def replay(self) -> None:
            raise AssertionError("never captured, never replayed")

    graphs = DecodeGraphs(
        [1, 2],
        lambda bucket: TritonShape(bucket, 0, 0, bucket, bucket, 1),
        lambda meta: torch.zeros(meta.shape.num_tokens, 3),
        torch.device("cpu"),
        BrokenGraph,
    )
    packed = torch.zeros(sum(TritonShape(2, 0, 0, 2, 2, 1).section_sizes().values()), dtype=torch.int64)
    assert graphs.run(2, packed, 2) is None
    assert graphs.bucket(2) is None  # its steps now run eagerly, without retrying the capture
    assert graphs.bucket(1) == 1
