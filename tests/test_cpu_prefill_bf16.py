"""`cpu_prefill_bf16`: a CPU step's prefill chunks through the modules under bfloat16 autocast. The logits move
by bfloat16 rounding only, the float32 path is untouched when it is off, and auto turns it on only where decodes
already round activations to int8 and the CPU has AMX tiles."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from swarmkv import LLM, SamplingParams
from swarmkv.core.config import EngineConfig
from swarmkv.engine import runner
from swarmkv.kernels import cpu_grouped
from tiny_gguf import write_tiny_gguf
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
    assert torch.equal(exact, _first_logits(tiny, cpu_prefill_bf16="off"))
    rounded = _first_logits(tiny, cpu_prefill_bf16="on")
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
        llm = LLM(
            str(tiny), dtype="float32", speculation=mode, cpu_prefill_bf16="on", kv_cache_memory="16MiB"
        )
        (out,) = llm.generate([prompt], params)
        replies[mode] = out.token_ids
        if mode == "on":
            assert llm.stats()["spec_verify_steps"] > 0
    assert replies["on"] == replies["off"]


@pytest.mark.skipif(not cpu_grouped.available(), reason="no C compiler for the CPU kernels")
@pytest.mark.parametrize("amx", [True, False])
def test_auto_follows_the_decode_steps_rounding_and_the_cpu(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, amx: bool
) -> None:
    """auto: bfloat16 prefills only where the CPU has AMX tiles and decodes run the C step on int8 activations
    (a GGUF-held model with int8-readable layouts); float checkpoints, weights the int8 kernel does not read
    (float16 rows, held as float32) and float32 decode activations keep float32 prefills. `on` forces it."""
    monkeypatch.setattr(runner, "amx_tiles", lambda: amx)
    assert not LLM(str(tiny), dtype="float32", kv_cache_memory="16MiB").engine.runner.prefill_bf16
    quantised = write_tiny_gguf(tmp_path / "q4.gguf", projections=Q.Q4_1)
    halves = write_tiny_gguf(
        tmp_path / "f16.gguf",
        projections=Q.F16,
        embedding=Q.Q8_0,  # a quantized embedding: the file is held at its bits; its layers are float rows
        types={f"blk.{i}.attn_output.weight": Q.F16 for i in range(2)},
    )
    held = LLM(str(quantised), dtype="float32", kv_cache_memory="16MiB").engine.runner
    assert held.cpu_decode is not None and held.cpu_decode.reads_int8
    assert held.prefill_bf16 == amx
    float_reads = LLM(str(halves), dtype="float32", kv_cache_memory="16MiB").engine.runner
    assert float_reads.cpu_decode is not None and not float_reads.cpu_decode.reads_int8  # float rows
    assert not float_reads.prefill_bf16
    exact = LLM(str(quantised), dtype="float32", kv_cache_memory="16MiB", cpu_int8_activations=False)
    assert not exact.engine.runner.prefill_bf16
    forced = LLM(str(quantised), dtype="float32", kv_cache_memory="16MiB", cpu_prefill_bf16="on")
    assert forced.engine.runner.prefill_bf16


def test_amx_tiles_is_false_where_torch_cannot_tell(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    assert runner.amx_tiles() is False
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert runner.amx_tiles() is True


def test_a_bad_value_is_refused() -> None:
    with pytest.raises(ValueError, match="cpu_prefill_bf16"):
        EngineConfig(cpu_prefill_bf16="sometimes")  # type: ignore[arg-type]
