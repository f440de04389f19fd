"""The whole-step C decode on Qwen3.5's hybrid (Gated DeltaNet layers over state slots, gated attention with
partial rotary) against the torch modules on the same engine: every decode step's logits and the states it
leaves, on tiny qwen35 GGUF files in every type the C step reads; and greedy replies through prefix hits
(state snapshots), speculation (the rewind) and async scheduling, C against the modules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from swarmkv import LLM, SamplingParams
from swarmkv.core.scheduler import StepPlan
from swarmkv.engine import cpu_decode
from swarmkv.engine.runner import ModelRunner
from swarmkv.kernels import cpu_grouped
from tiny_gguf import write_tiny_gguf

Q = GGMLQuantizationType
pytestmark = pytest.mark.skipif(not cpu_grouped.available(), reason="no C compiler for the CPU kernels")

# Every type the C step reads, each as the projections of one file (Q6_K rows beside Q4_K ones in the mix).
FILES: dict[str, dict[str, Any]] = {
    "q4_0": dict(projections=Q.Q4_0),
    "q4_1": dict(projections=Q.Q4_1),
    "q5_0": dict(projections=Q.Q5_0),
    "q5_1": dict(projections=Q.Q5_1),
    "q8_0": dict(projections=Q.Q8_0),
    "q5_k": dict(projections=Q.Q5_K),
    "q6_k": dict(projections=Q.Q6_K),
    "q4_k_m": dict(projections=Q.Q4_K, embedding=Q.Q6_K, types={"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K}),
}
SHARED = list(range(40, 120))
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("cpu-decode-hybrid")
    return {name: write_tiny_gguf(folder / f"{name}.gguf", "qwen35", **spec) for name, spec in FILES.items()}


class Checked:
    """Wraps a hybrid's runner: each decode-only step runs through C, then from the same states again through
    the torch modules; the logits and the states each leaves are compared, and C's kept."""

    def __init__(self, runner: ModelRunner) -> None:
        assert runner.states is not None
        self.runner, self.run, self.states = runner, runner.run, runner.states
        self.steps, self.rows, self.same_top1 = 0, 0, 0
        self.worst_logits, self.worst_state = 0.0, 0.0

    def __call__(self, plan: StepPlan, *provisional: Any) -> tuple[list, torch.Tensor]:  # type: ignore[type-arg]
        fused = self.runner.cpu_decode
        if fused is None or not all(c.kind == "decode" and not c.draft for c in plan.chunks):
            return self.run(plan, *provisional)
        before = self.states.conv.clone(), self.states.ssm.clone()
        chunks, logits = self.run(plan, *provisional)
        after = self.states.conv.clone(), self.states.ssm.clone()
        self.states.conv.copy_(before[0])
        self.states.ssm.copy_(before[1])
        self.runner.cpu_decode = None
        try:
            torch_chunks, reference = self.run(plan, *provisional)
        finally:
            self.runner.cpu_decode = fused
        by_id = {c.request_id: i for i, c in enumerate(torch_chunks)}
        reference = reference[[by_id[c.request_id] for c in chunks]]
        self.worst_logits = max(
            self.worst_logits, float((logits - reference).abs().max() / reference.abs().max())
        )
        for mine, theirs in zip(after, (self.states.conv, self.states.ssm), strict=True):
            self.worst_state = max(self.worst_state, float((mine - theirs).abs().max() / theirs.abs().max()))
        self.states.conv.copy_(after[0])
        self.states.ssm.copy_(after[1])
        self.steps += 1
        self.rows += len(chunks)
        self.same_top1 += int((logits.argmax(-1) == reference.argmax(-1)).sum())
        return chunks, logits


def checked_llm(path: Path, **options: Any) -> tuple[LLM, Checked]:
    options.setdefault("speculation", "off")
    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", **options)
    runner = llm.engine.runner
    assert runner.cpu_decode is not None, cpu_decode.why_not(
        llm.loaded.model, runner.kv_cache, llm.loaded.device
    )
    check = Checked(runner)
    runner.run = check  # type: ignore[method-assign]
    return llm, check


PROMPTS: list[list[int]] = [[5, 9, 300, 12], SHARED + [7, 8], SHARED + [901, 3, 4, 5, 6], list(range(1, 50))]


@pytest.mark.parametrize("name", list(FILES))
def test_hybrid_decode_matches_the_torch_modules(files: dict[str, Path], name: str) -> None:
    """Float32 activations: the modules' arithmetic summed in another order, logits and states alike."""
    llm, check = checked_llm(files[name], cascade_attention="on", cpu_int8_activations=False)
    outputs = llm.generate(PROMPTS, GREEDY)  # type: ignore[arg-type]
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outputs)
    assert check.steps >= GREEDY.max_tokens - 1
    assert check.same_top1 == check.rows
    assert check.worst_logits < 1e-4, f"largest logit difference {check.worst_logits:.2e} of the largest"
    assert check.worst_state < 1e-4, f"largest state difference {check.worst_state:.2e} of the largest"


@pytest.mark.parametrize("name", ["q8_0", "q4_k_m"])
def test_hybrid_int8_activations_stay_close(files: dict[str, Path], name: str) -> None:
    """x rounded to int8 per group of 32 moves the logits by a few percent, rarely the top token."""
    llm, check = checked_llm(files[name], cascade_attention="on")
    llm.generate(PROMPTS, GREEDY)  # type: ignore[arg-type]
    assert check.steps >= GREEDY.max_tokens - 1
    assert check.worst_logits < 0.15, f"largest logit difference {check.worst_logits:.2e} of the largest"
    assert check.same_top1 >= 0.9 * check.rows


def _replies(path: Path, prompts: list[list[int]], rounds: int = 1, **options: Any) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", kv_cache_memory="64MiB", cpu_int8_activations=False, **options)
    replies: list[list[int]] = []
    for _ in range(rounds):  # later rounds hit the prefix cache: a state snapshot and its pages
        replies += [o.token_ids for o in llm.generate(prompts, GREEDY)]  # type: ignore[arg-type]
    return replies


@pytest.mark.parametrize(
    "options",
    [
        dict(speculation="off", async_scheduling="on"),
        dict(speculation="on"),
        dict(speculation="off", max_num_batched_tokens=32),
    ],
    ids=["async", "speculation", "chunked-prefill"],
)
def test_hybrid_greedy_replies_are_the_modules(files: dict[str, Path], options: dict[str, Any]) -> None:
    """Through prefix hits (snapshots), drafts (the rewind: a draft's positions run through the modules),
    async scheduling and chunked prefills beside decodes, C decodes give the modules' greedy replies."""
    path = files["q8_0"]
    prompts = [SHARED + [7, 8], SHARED + [9, 10, 11], [5, 6, 5, 6, 5, 6, 5, 6]]
    fused = _replies(path, prompts, rounds=2, **options)
    modules = _replies(path, prompts, rounds=2, fused_cpu_decode=False, **options)
    assert fused == modules
