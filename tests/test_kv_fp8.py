"""fp8 KV pages: a quarter of float32's bytes per token, calibrated scales, the same answers."""

from __future__ import annotations

import pytest

from swarmkv import LLM, SamplingParams
from swarmkv.cli import main
from swarmkv.engine.kv_cache import FP8


@pytest.fixture(scope="module")
def pair() -> tuple[LLM, LLM]:
    full = LLM(weights="int8", kv_cache_memory="64MiB")
    return full, LLM(loaded=full.loaded, kv_cache_memory="64MiB", kv_cache_dtype="fp8_e4m3")


@pytest.mark.model
@pytest.mark.slow
def test_fp8_pages_hold_four_times_the_float32_tokens(pair: tuple[LLM, LLM]) -> None:
    full, fp8 = pair
    assert fp8.engine.runner.kv_cache.k.dtype == FP8
    assert fp8.stats()["kv_bytes_per_token"] * 4 == full.stats()["kv_bytes_per_token"]
    assert fp8.engine.core.kv.num_pages == 4 * full.engine.core.kv.num_pages


@pytest.mark.model
@pytest.mark.slow
def test_fp8_scales_are_calibrated_per_layer(pair: tuple[LLM, LLM]) -> None:
    cache = pair[1].engine.runner.kv_cache
    assert all(s > 0 for s in cache.k_scales + cache.v_scales)
    assert len(set(cache.k_scales)) > 1  # one per layer, from what each layer produced


@pytest.mark.model
@pytest.mark.slow
def test_fp8_kv_keeps_the_answer(pair: tuple[LLM, LLM]) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    expected, got = (llm.generate([question], params)[0] for llm in pair)
    assert "Paris" in expected.text and "Paris" in got.text
    pair[1].engine.check_integrity()


def test_unknown_kv_dtype_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(kv_cache_dtype="int2")
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--kv-cache-dtype", "fp4", "--prompt", "hi"])
    assert exit_info.value.code == 2
    assert "fp8_e4m3" in capsys.readouterr().err
