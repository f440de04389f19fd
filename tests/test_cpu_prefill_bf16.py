"""`cpu_prefill_bf16`: a CPU step's prefill chunks through the modules under bfloat16 autocast. The logits move
by bfloat16 rounding only, and the float32 path is untouched when it is off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from swarmkv import LLM, SamplingParams
from tiny_models import make_tiny_checkpoint

PROMPT = [(37 * i + 11) % 500 for i in range(96)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bf16") / "qwen3", "qwen3")


def _first_logits(path: Path, **options: Any) -> torch.Tensor:
    """The logits of a prompt's prefill step (one chunk), through an engine with `options`."""
    llm = LLM(str(path), dtype="float32", speculation="off", **options)
    seen: list[torch.Tensor] = []
    run = llm.engine.runner.run

    def spy(plan: Any, *provisional: Any) -> Any:
        chunks, logits = run(plan, *provisional)
        seen.append(logits.clone())
        return chunks, logits

    llm.engine.runner.run = spy  # type: ignore[method-assign]
    llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=2))
    llm.engine.check_integrity()
    return seen[0]


def test_bfloat16_prefill_moves_the_logits_by_rounding_only(tiny: Path) -> None:
    exact = _first_logits(tiny)
    assert torch.equal(exact, _first_logits(tiny, cpu_prefill_bf16=False))
    rounded = _first_logits(tiny, cpu_prefill_bf16=True)
    assert rounded.dtype == torch.float32
    assert not torch.equal(rounded, exact), "the prefill ran in bfloat16"
    scale = float(exact.abs().max())
    assert float((rounded - exact).abs().max()) < 0.05 * scale
    assert torch.equal(rounded.argmax(-1), exact.argmax(-1))


def test_drafts_are_verified_in_float32(tiny: Path) -> None:
    """A speculative chunk runs through the modules like a prefill, but its rows verify drafts: they stay in
    float32, so greedy output with speculation equals it without."""
    prompt = [(37 * i + 11) % 500 for i in range(20)] * 4
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    replies = {}
    for mode in ("off", "on"):
        llm = LLM(str(tiny), dtype="float32", speculation=mode, cpu_prefill_bf16=True)
        (out,) = llm.generate([prompt], params)
        replies[mode] = out.token_ids
        if mode == "on":
            assert llm.stats()["spec_verify_steps"] > 0
    assert replies["on"] == replies["off"]
