"""A failed step fails its requests and nothing else; typed refusals; honest counters; cascade really used."""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest

from engine_helpers import TINY_VOCAB, tiny_llm
from swarmkv import SamplingParams
from swarmkv.core.scheduler import StepPlan
from swarmkv.errors import InvalidRequestError
from swarmkv.server import ServerConfig, create_app
from swarmkv.server.background import BackgroundServer

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def head(n: int, seed: int = 0) -> list[int]:
    return [(31 * i + 7 * seed) % TINY_VOCAB for i in range(n)]


class FailOnce:
    """Wraps a callable so that its next `times` calls raise."""

    def __init__(self, fn: Any, times: int = 1) -> None:
        self.fn = fn
        self.times = times

    def __call__(self, *args: Any) -> Any:
        if self.times > 0:
            self.times -= 1
            raise RuntimeError("injected fault")
        return self.fn(*args)


@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_a_failed_step_fails_its_requests_and_leaves_no_stale_state(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = tiny_llm(block_size=4, check_writes=True)
    engine = llm.engine
    prompt = head(40)
    (reference,) = llm.generate([prompt], GREEDY)
    engine.add_request("doomed", prompt + [5, 6, 7], GREEDY)
    engine.add_request("other", head(30, seed=1), GREEDY)
    if where == "forward":
        monkeypatch.setattr(engine.runner, "run", FailOnce(engine.runner.run))
    else:
        import swarmkv.engine.executor as engine_module

        monkeypatch.setattr(engine_module, "sample", FailOnce(engine_module.sample))
    deltas = engine.step()
    assert {d.request_id for d in deltas} == {"doomed", "other"}
    assert all(d.finished and d.error and d.finish_reason == "error" for d in deltas)
    assert not engine.healthy and not engine.has_unfinished()
    engine.check_integrity()
    assert engine.core.kv.num_in_use == 0, "the failed requests' pages came back"
    assert engine.stats()["requests_failed"] == 2
    # The next request is served normally, and from the same cache: same tokens as before the fault.
    (again,) = llm.generate([prompt], GREEDY)
    assert again.error is None and again.token_ids == reference.token_ids
    assert again.num_cached_tokens > 0
    assert engine.healthy
    engine.check_integrity()


def test_a_failed_step_is_a_server_error_and_health_recovers(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = tiny_llm()
    app = create_app(llm, ServerConfig(served_model_name="tiny"))
    body = {"model": "tiny", "prompt": head(20), "max_tokens": 4, "temperature": 0}
    with BackgroundServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/health").status_code == 200
        # The request fails, then the probe /health runs on the idle engine fails too: still broken.
        fault = FailOnce(llm.engine.runner.run, times=2)
        monkeypatch.setattr(llm.engine.runner, "run", fault)
        failed = http.post("/v1/completions", json=body)
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        health = http.get("/health")
        assert health.status_code == 503 and "injected fault" in health.json()["error"]
        assert fault.times == 0
        assert http.get("/health").status_code == 200, "the next probe runs and succeeds"
        streamed = http.post("/v1/completions", json={**body, "stream": True})
        assert streamed.status_code == 200 and '"error"' not in streamed.text
        ok = http.post("/v1/completions", json=body)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"
        metrics = http.get("/metrics").text
        assert "swarmkv_failed_steps_total 2.0" in metrics  # the request's step and the first probe
        assert "swarmkv_recomputed_tokens_total" in metrics
    app.state.ctx.engine.engine.check_integrity()


@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_sampling_values_are_refused(field: str, value: float) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert isinstance(info.value, ValueError)


def test_counters_add_up_through_preemption() -> None:
    llm = tiny_llm(block_size=4, kv_cache_memory=20 * 4 * 1024, max_num_batched_tokens=16)
    engine = llm.engine
    prompts = [head(24, seed=s) + [s] * 5 for s in range(4)]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        s = engine.stats()
        assert (
            s["prefill_tokens_computed"]
            == s["prompt_tokens"] - s["prefix_hit_tokens"] + s["recomputed_tokens"]
        )
    s = engine.stats()
    assert s["preemptions"] > 0 and s["recomputed_tokens"] > 0
    assert s["prompt_tokens"] == sum(len(p) for p in prompts)
    # Hits count once per request: never more than the prompts' tokens that were not computed.
    assert s["prefix_hit_tokens"] <= s["prompt_tokens"] - (
        s["prefill_tokens_computed"] - s["recomputed_tokens"]
    )


def test_salted_requests_leave_no_empty_roots() -> None:
    llm = tiny_llm(block_size=4)
    engine = llm.engine
    for i in range(10_000):
        engine.add_request(f"r{i}", [1, 2, 3, 4, 5, 6], GREEDY, cache_salt=f"agent-{i}")
        engine.abort(f"r{i}")
    assert engine.core.kv.index.num_roots == 0 and engine.core.kv.index.num_pages == 0
    engine.check_integrity()


def swarm(mode: str, n: int = 4, prefix: int = 1100) -> tuple[list[list[int]], dict[str, Any]]:
    # All four prefilled in one step (no partial-prefill limit), so their decodes run in step together.
    llm = tiny_llm(block_size=16, cascade_attention=mode, max_num_partial_prefills=0)
    prompts = [head(prefix) + head(8 + i, seed=i + 1) for i in range(n)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    return [o.token_ids for o in outs], llm.stats()


def test_cascade_is_used_on_a_long_shared_head_and_changes_no_token() -> None:
    auto, auto_stats = swarm("auto")
    off, off_stats = swarm("off")
    assert auto == off
    # Every decode of the 4 agents after the first step runs in one group over the 1,100-token head.
    assert auto_stats["cascade_decode_rows"] >= 4 * 6
    assert auto_stats["cascade_shared_tokens"] >= 6 * 1088
    assert off_stats["cascade_decode_rows"] == 0


def test_auto_cascade_skips_a_short_common_head() -> None:
    _, stats = swarm("auto", prefix=32)  # two common pages: not worth an extra pass
    assert stats["cascade_decode_rows"] == 0
    _, forced = swarm("on", prefix=32)
    assert forced["cascade_decode_rows"] > 0


def test_cascade_groups_form_per_shared_head() -> None:
    llm = tiny_llm(block_size=16, cascade_attention="auto")
    engine = llm.engine
    heads = [head(1100, seed=10), head(1100, seed=20)]
    for i in range(8):
        engine.add_request(f"r{i}", heads[i % 2] + head(5 + i, seed=i), GREEDY)
    cascaded: list[int] = []
    run = engine.runner.run

    def spy(plan: StepPlan, *provisional: Any) -> Any:
        before = engine.counters.cascade_decode_rows
        out = run(plan, *provisional)
        cascaded.append(engine.counters.cascade_decode_rows - before)
        return out

    engine.runner.run = spy  # type: ignore[method-assign]
    while engine.has_unfinished():
        engine.step()
    # Two swarms of four: both heads are read once per step, so all eight decodes are cascaded.
    assert max(cascaded) == 8


def test_a_request_given_up_between_steps_leaves_no_page_table_row() -> None:
    llm = tiny_llm(block_size=4, kv_cache_memory=4 * 4 * 1024, max_num_seqs=2)
    engine = llm.engine
    for i in range(3):  # each outgrows the 4-page pool while running alone and is given up
        (out,) = llm.generate(
            [head(10, seed=i)], SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        )
        assert out.finish_reason == "length" and out.error is None
        engine.check_integrity()
    assert engine.runner.page_table.request_ids == set()
    outs = llm.generate(
        [head(3), head(3, seed=1)], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    )
    assert all(o.error is None for o in outs)


def test_a_huge_top_k_samples_like_no_top_k() -> None:
    llm = tiny_llm()
    seeded = SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True)
    (plain,) = llm.generate([head(12)], seeded)
    (huge,) = llm.generate(
        [head(12)], SamplingParams(temperature=1.0, seed=3, max_tokens=8, ignore_eos=True, top_k=10**20)
    )
    assert huge.error is None and huge.token_ids == plain.token_ids
