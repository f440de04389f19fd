"""Async scheduling (engine/lookahead.py): each step scheduled and launched before the previous step's ids are
read, its provisional inputs taken from them on the device. On float64 and float32 models the tokens equal a
synchronous engine's over chunked prefills, shared heads, stop tokens, preemption, aborts, failed steps,
drafts, hybrids and (interpreted) triton graph replays; the books balance after every step."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine_helpers import FEWER_HEADS, FEWER_HYBRID_HEADS, TINY_VOCAB, tiny_llm
from swarmkv import LLM, SamplingParams
from swarmkv.core.config import EngineConfig
from swarmkv.core.sequence import PROVISIONAL_TOKEN
from swarmkv.engine.engine import LLMEngine
from swarmkv.models.loader import LoadedModel, load_model
from tiny_models import lengthen_recurrent_memory, make_tiny_checkpoint

MODES = ("off", "on")
GREEDY_12 = SamplingParams(temperature=0.0, max_tokens=12)


def _workload(seed: int, num_requests: int = 10) -> list[tuple[list[int], SamplingParams]]:
    """Prompts over two shared heads with random tails; greedy and seeded sampling; random lengths and stop
    ids, so replies end by stop and by length at different steps."""
    rng = random.Random(seed)
    heads = [[rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(8, 40))] for _ in range(2)]
    out = []
    for i in range(num_requests):
        prompt = heads[i % 2] + [rng.randrange(TINY_VOCAB) for _ in range(rng.randrange(1, 30))]
        stops = [rng.randrange(TINY_VOCAB) for _ in range(12)]
        if i % 3 == 2:
            params = SamplingParams(
                temperature=0.8, seed=i, max_tokens=rng.randrange(1, 30), stop_token_ids=stops
            )
        else:
            params = SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 30), stop_token_ids=stops)
        out.append((prompt, params))
    return out


def _drive(
    engine: LLMEngine, work: list[tuple[list[int], SamplingParams]]
) -> dict[str, tuple[list[int], str]]:
    """Every request's tokens and finish reason, stepping until done; integrity checked after each step, and
    no provisional id ever left in a finished reply."""
    for i, (prompt, params) in enumerate(work):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(work))}
    reasons: dict[str, str] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
            if delta.finished:
                assert delta.finish_reason is not None
                reasons[delta.request_id] = delta.finish_reason
        engine.check_integrity()
    assert all(PROVISIONAL_TOKEN not in t for t in tokens.values())
    assert engine.core.kv.num_in_use == 0, "every page came back"
    return {rid: (tokens[rid], reasons[rid]) for rid in tokens}


def test_auto_looks_ahead_on_a_gpu_only_and_bad_values_are_refused() -> None:
    assert not EngineConfig().lookahead("cpu")
    assert EngineConfig().lookahead("cuda")
    assert EngineConfig(async_scheduling="on").lookahead("cpu")
    assert not EngineConfig(async_scheduling="off").lookahead("cuda")
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="sometimes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [
        {},  # one prefill chunk a request, prefix caching on
        {"max_num_batched_tokens": 16, "max_num_seqs": 4},  # chunked prefills beside lookahead decodes
        {"kv_cache_memory": 96 * 1024, "max_num_seqs": 6},  # a tight pool: preemption with a step in flight
        {"prefix_caching": False},
    ],
    ids=["plain", "chunked", "preempting", "per-slot"],
)
def test_lookahead_gives_a_synchronous_engines_tokens(options: dict[str, Any]) -> None:
    work = _workload(seed=len(options))
    results, engines = {}, {}
    for mode in MODES:
        engine = tiny_llm(async_scheduling=mode, speculation="off", block_size=4, **options).engine
        results[mode], engines[mode] = _drive(engine, work), engine
    assert results["on"] == results["off"]
    assert {reason for _, reason in results["on"].values()} == {"stop", "length"}
    assert engines["off"].counters.lookahead_steps == 0
    assert engines["on"].counters.lookahead_steps > engines["on"].counters.steps // 2
    on, off = engines["on"].stats(), engines["off"].stats()
    assert on["lookahead_steps"] == engines["on"].counters.lookahead_steps
    assert on["generated_tokens"] == off["generated_tokens"]
    if "kv_cache_memory" in options:
        assert on["preemptions"] > 0


def test_a_reply_ended_by_a_stop_token_keeps_the_position_the_next_step_computed() -> None:
    """The step after a stop token already computed it: that KV is committed before the request is freed,
    so a next turn continuing the reply hits it, one position more than a synchronous engine caches."""
    prompt = list(range(40, 70))
    (reference,) = tiny_llm(speculation="off").generate(
        [prompt], SamplingParams(temperature=0.0, max_tokens=12)
    )
    stop = reference.token_ids[5]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop])
    cached = {}
    for mode in MODES:
        llm = tiny_llm(async_scheduling=mode, speculation="off", block_size=4)
        (first,) = llm.generate([prompt], params)
        assert (
            first.finish_reason == "stop"
            and first.token_ids == reference.token_ids[: first.token_ids.index(stop) + 1]
        )
        (second,) = llm.generate(
            [prompt + first.token_ids + [1, 2]], SamplingParams(temperature=0.0, max_tokens=2)
        )
        cached[mode] = second.num_cached_tokens
        llm.engine.check_integrity()
    turn = len(prompt) + len(first.token_ids)
    assert cached["off"] == turn - 1 and cached["on"] == turn


def test_an_abort_while_its_step_is_in_flight_loses_nothing() -> None:
    work = _workload(seed=7, num_requests=3)
    expected = _drive(tiny_llm(speculation="off", block_size=4).engine, work)
    engine = tiny_llm(async_scheduling="on", speculation="off", block_size=4).engine
    long_reply = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, (prompt, params) in enumerate(work):
        engine.add_request(f"r{i}", prompt, long_reply if i == 0 else params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    while engine.lookahead.in_flight is None or "r0" not in {
        c.request_id for c in engine.lookahead.in_flight.sampling
    }:
        for delta in engine.step():
            tokens[delta.request_id] += delta.new_token_ids
    aborted = engine.get_sequence("r0")
    assert aborted is not None and aborted.num_provisional_tokens == 1
    assert aborted.settled_output_token_ids == tokens["r0"]
    assert engine.abort("r0")
    engine.check_integrity()
    while engine.has_unfinished():
        for delta in engine.step():
            assert delta.request_id != "r0"
            tokens[delta.request_id] += delta.new_token_ids
        engine.check_integrity()
    assert engine.core.kv.num_in_use == 0
    assert {rid: tokens[rid] for rid in ("r1", "r2")} == {rid: expected[rid][0] for rid in ("r1", "r2")}
    assert aborted.output_token_ids == tokens["r0"], "the in-flight token, never shown, is not kept"


def test_a_failed_step_still_delivers_the_step_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step launched after a lookahead fails: the step before it still yields its tokens, and only the
    failed step's requests end in an error."""
    engine = tiny_llm(async_scheduling="on", speculation="off", block_size=4).engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", list(range(10, 30)), params)
    while engine.lookahead.in_flight is None:
        engine.step()
    run = engine.runner.run

    def failing(*args: Any) -> Any:
        monkeypatch.setattr(engine.runner, "run", run)
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.runner, "run", failing)
    deltas = engine.step()
    delivered, failed = deltas  # the in-flight step's token, then the failure
    assert len(delivered.new_token_ids) == 1 and not delivered.finished
    assert failed.finished and failed.finish_reason == "error" and failed.error
    assert not engine.has_unfinished() and engine.core.kv.num_in_use == 0
    engine.check_integrity()


@pytest.mark.parametrize("guard", ["off", "all"])
def test_steps_whose_tokens_the_next_schedule_needs_are_waited_for(guard: str) -> None:
    """Drafts (verified on the host) and the loop guard (a penalty from the last token) need each step's
    tokens before the next is scheduled: under the guard nothing runs ahead; with drafts, steps run ahead
    while their requests have nothing to draft (a prompt that repeats nothing) or back off. The tokens stay
    a synchronous engine's."""
    rng = random.Random(3)
    motif = [rng.randrange(TINY_VOCAB) for _ in range(6)]
    repeating = [motif * 6 + [rng.randrange(TINY_VOCAB) for _ in range(i)] for i in range(1, 3)]
    plain = [[rng.randrange(TINY_VOCAB) for _ in range(20)] for _ in range(2)]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    results, engines = {}, {}
    for mode in MODES:
        for batch in (repeating, plain):
            engine = tiny_llm(async_scheduling=mode, speculation="on", loop_guard=guard, block_size=4).engine
            results[mode, len(batch[0])] = _drive(engine, [(p, greedy) for p in batch])
            engines[mode, len(batch[0])] = engine
    assert all(results["on", key[1]] == results["off", key[1]] for key in results)
    drafted, idle = engines["on", len(repeating[0])], engines["on", len(plain[0])]
    if guard == "all":
        assert drafted.counters.lookahead_steps == idle.counters.lookahead_steps == 0
    else:
        assert drafted.stats()["spec_verify_steps"] > 0
        assert idle.counters.lookahead_steps > 0


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    """The tiny Qwen3.5 (three Gated DeltaNet layers, one gated attention layer) in float32, its states
    decaying slowly so that a state lost or mixed up changes the outputs."""
    folder = tmp_path_factory.mktemp("hybrid") / "qwen3_5"
    make_tiny_checkpoint(folder, "qwen3_5", vocab_size=512, **FEWER_HYBRID_HEADS)  # for the interpreted test
    return load_model(lengthen_recurrent_memory(folder), dtype="float32")


@pytest.mark.usefixtures("one_torch_thread")
def test_a_hybrid_runs_ahead_and_keeps_exact_states(hybrid: LoadedModel) -> None:
    """A hybrid's recurrent state advances with the step launched ahead; the next turns (hits on the
    snapshots the first turns left) give a synchronous engine's tokens."""
    head = [(7 * i + 3) % 300 for i in range(40)]
    prompts = [head + [300 + i, 301, 302 + i] for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    (probe,) = LLM(loaded=hybrid, kv_cache_memory="8MiB", block_size=16).generate(prompts[:1], greedy)
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[probe.token_ids[4]])
    outputs = {}
    for mode in MODES:
        llm = LLM(
            loaded=hybrid, kv_cache_memory="8MiB", block_size=16, async_scheduling=mode, speculation="off"
        )
        first = llm.generate(prompts, params)
        second = llm.generate(
            [p + o.token_ids + [11, 12] for p, o in zip(prompts, first, strict=True)], greedy
        )
        llm.engine.check_integrity()
        outputs[mode] = [o.token_ids for o in first + second], llm.engine.counters.lookahead_steps
    assert outputs["on"][0] == outputs["off"][0]
    assert outputs["off"][1] == 0 < outputs["on"][1]


@pytest.mark.slow
def test_triton_graph_replays_read_their_inputs_from_the_step_before(tmp_path: Path) -> None:
    """On the triton backend, eager and replayed from (stand-in) graphs, a provisional input is written into
    the step's device metadata after its copy: the tokens equal the torch backend's, synchronous."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from swarmkv.engine.cuda_graphs import DecodeGraphs, EagerGraph, batch_buckets

    folder = make_tiny_checkpoint(
        tmp_path / "qwen3", "qwen3", **FEWER_HEADS
    )  # half the interpreter's programs
    prompts = [list(range(100, 130)) + [7, 8 + i] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def tokens(backend: str, mode: str) -> tuple[list[list[int]], LLM]:
        llm = LLM(
            str(folder),
            dtype="float32",
            device=device,
            attention_backend=backend,
            block_size=4,
            async_scheduling=mode,
            speculation="off",
            kv_cache_memory="8MiB",  # the default 1 GiB pool took seconds to zero, for 100 tokens
        )
        runner = llm.engine.runner.triton
        if runner is not None and device == "cpu":
            runner.graphs = DecodeGraphs(
                batch_buckets(4), runner._graph_shape, runner.forward, runner.device, EagerGraph
            )
        return [o.token_ids for o in llm.generate(prompts, params)], llm

    expected, _ = tokens("torch", "off")
    got, llm = tokens("triton", "on")
    assert got == expected
    runner = llm.engine.runner.triton
    assert runner is not None and runner.graphs is not None and runner.graphs.replays > 0
    assert llm.engine.counters.lookahead_steps > 0


def test_the_server_streams_a_looking_ahead_engines_replies() -> None:
    """Over HTTP, with steps scheduled ahead: concurrent streamed and whole replies equal a synchronous
    engine's, and /metrics counts the lookahead steps."""
    import concurrent.futures

    import httpx

    from swarmkv.server import ServerConfig, create_app
    from swarmkv.server.background import BackgroundServer

    bodies = [
        {"model": "tiny", "prompt": list(range(10 + i, 40 + i)), "max_tokens": 12, "temperature": 0}
        for i in range(4)
    ]
    expected = [o.token_ids for o in tiny_llm().generate([b["prompt"] for b in bodies], GREEDY_12)]
    llm = tiny_llm(async_scheduling="on", speculation="off")
    app = create_app(llm, ServerConfig(served_model_name="tiny"))
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:

        def complete(body: dict[str, Any]) -> str:
            return str(http.post("/v1/completions", json=body).json()["choices"][0]["text"])

        def stream(body: dict[str, Any]) -> str:
            reply = http.post("/v1/completions", json={**body, "stream": True})
            assert reply.status_code == 200 and '"error"' not in reply.text
            events = [line[len("data: ") :] for line in reply.text.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            return "".join(
                json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"]
            )

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(complete, bodies))
            streams = list(pool.map(stream, bodies))
        metrics = http.get("/metrics").text
    tokenizer = llm.tokenizer
    assert texts == [tokenizer.decode(t) for t in expected]
    assert streams == texts
    assert "swarmkv_lookahead_steps_total" in metrics and "swarmkv_lookahead_steps_total 0.0" not in metrics
    app.state.ctx.engine.engine.check_integrity()


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_hybrids_graph_replays_run_ahead_on_triton(hybrid: LoadedModel) -> None:
    """Qwen3.5 on the triton backend, its decodes replayed from (stand-in) graphs that read their state slots
    and, under async scheduling, their provisional inputs from the device: the torch backend's tokens,
    synchronous, with replies ended by a stop token and by length."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from swarmkv.engine.cuda_graphs import DecodeGraphs, EagerGraph, batch_buckets

    head = [(7 * i + 3) % 300 for i in range(24)]
    prompts = [head + [300 + i, 301] for i in range(3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    options: dict[str, Any] = {"kv_cache_memory": "8MiB", "block_size": 16, "speculation": "off"}
    (probe,) = LLM(loaded=hybrid, **options).generate(prompts[:1], greedy)
    params = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[probe.token_ids[3]])
    expected = [o.token_ids for o in LLM(loaded=hybrid, **options).generate(prompts, params)]
    llm = LLM(loaded=hybrid, attention_backend="triton", async_scheduling="on", **options)
    runner = llm.engine.runner.triton
    assert runner is not None
    runner.graphs = DecodeGraphs(
        batch_buckets(4), runner._graph_shape, runner.forward, runner.device, EagerGraph
    )
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert runner.graphs.replays > 0 and llm.engine.counters.lookahead_steps > 0
    llm.engine.check_integrity()


def test_ids_that_cannot_be_read_back_fail_their_requests_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device copy of a step's ids fails (on a GPU: an error surfacing at the event): that step's requests
    end in an error, the step launched after it commits nothing of theirs, and every page comes back."""
    from swarmkv.engine.lookahead import InFlight

    engine = tiny_llm(async_scheduling="on", speculation="off", block_size=4).engine
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("a", list(range(10, 30)), params)
    while engine.lookahead.in_flight is None:
        engine.step()

    def unreadable(self: InFlight) -> list[int]:
        raise RuntimeError("injected copy fault")

    monkeypatch.setattr(InFlight, "tokens", unreadable)
    (failed,) = engine.step()
    assert failed.finished and failed.finish_reason == "error" and failed.error
    assert not engine.healthy
    monkeypatch.undo()
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    assert engine.core.kv.num_in_use == 0
    (again,) = engine_outputs(engine, list(range(10, 30)), params)
    assert len(again) == 20 and engine.healthy


def engine_outputs(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """One more request through `engine`, stepped to its end: its tokens."""
    engine.add_request("after", prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished():
        for delta in engine.step():
            tokens += delta.new_token_ids
        engine.check_integrity()
    return [tokens]
