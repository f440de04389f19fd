"""The whole-step C decode runs a hybrid's speculative chunks (a request's last token and its draft, a row per
position): each step with a draft runs through C, then from the same states again through the torch modules, and
the logits, the states each leaves and the states kept after every position for the rewind are compared, on tiny
qwen35 GGUFs in float32; drafts fully and partly accepted, beside plain decodes of other slots in the same step.
Greedy replies through the C step equal the modules' and speculation off's, through prefix hits (snapshots) and
async scheduling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType

from swarmkv import LLM, SamplingParams
from swarmkv.core.scheduler import Chunk, StepPlan
from swarmkv.engine.runner import ModelRunner
from swarmkv.engine.state_cache import StateCache
from swarmkv.kernels import cpu_grouped
from tiny_gguf import write_tiny_gguf

Q = GGMLQuantizationType
pytestmark = pytest.mark.skipif(not cpu_grouped.available(), reason="no C compiler for the CPU kernels")

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
SHARED = list(range(40, 120))
# Repeating prompts give the drafter its own context to copy (a random model's reply follows it a while, then
# parts), and the fresh one drafts little: steps with drafts beside plain decodes.
PROMPTS: list[list[int]] = [
    [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7],
    SHARED + [9, 9, 9, 9, 9, 9],
    [300, 12, 301, 13, 302, 14],
]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("cpu-decode-hybrid-drafts")
    mix = dict(projections=Q.Q4_K, embedding=Q.Q6_K, types={"attn_v": Q.Q6_K, "ffn_down": Q.Q6_K})
    return {
        "q8_0": write_tiny_gguf(folder / "q8_0.gguf", "qwen35", projections=Q.Q8_0),
        "q4_k_m": write_tiny_gguf(folder / "q4_k_m.gguf", "qwen35", seed=1, **mix),  # type: ignore[arg-type]
    }


def kept_states(states: StateCache) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The per-position states the step kept, by slot: conv windows [layers, n, C, K-1], states [layers, n, ...]
    (copies; the StateCache's own record, which `rewind` reads)."""
    out = {}
    for slot, kept in states._positions.items():
        conv = torch.stack([kept.conv[layer] for layer in sorted(kept.conv)])
        ssm = torch.stack([torch.stack(kept.ssm[layer]) for layer in sorted(kept.ssm)])
        out[slot] = conv.clone(), ssm.clone()
    return out


def relative(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    """The largest difference over the largest magnitude."""
    return float((mine - theirs).abs().max() / theirs.abs().max().clamp_min(1e-30))


def in_order(chunks: list[Chunk], theirs: list[Chunk]) -> torch.Tensor:
    """The rows of logits of `theirs` (the same chunks in another order) in the order of `chunks`'."""
    first, row = {}, 0
    for chunk in theirs:
        first[chunk.request_id] = row
        row += chunk.num_logits
    return torch.tensor([first[c.request_id] + j for c in chunks for j in range(c.num_logits)])


class Checked:
    """Wraps a hybrid's runner: each step with a draft chunk (and decodes only) runs through C, then from the
    same states again through the torch modules; logits, states after and kept states are compared, C's kept.
    Each rewind is recorded as (positions kept, positions in the chunk)."""

    def __init__(self, runner: ModelRunner) -> None:
        assert runner.states is not None and runner.cpu_decode is not None
        self.runner, self.run, self.states = runner, runner.run, runner.states
        self.steps = self.mixed_steps = self.rows = self.same_top1 = 0
        self.worst_logits = self.worst_state = self.worst_kept = 0.0
        self.rewinds: list[tuple[int, int]] = []
        rewind = self.states.rewind

        def recorded(slot: int, num_positions: int) -> None:
            self.rewinds.append((num_positions, len(next(iter(self.states._positions[slot].ssm.values())))))
            rewind(slot, num_positions)

        self.states.rewind = recorded  # type: ignore[method-assign]

    def __call__(self, plan: StepPlan, *provisional: Any) -> tuple[list[Chunk], torch.Tensor]:
        fused = self.runner.cpu_decode
        drafts = [c for c in plan.chunks if c.draft]
        if fused is None or not drafts or any(c.kind != "decode" for c in plan.chunks):
            return self.run(plan, *provisional)
        before = self.states.conv.clone(), self.states.ssm.clone()
        chunks, logits = self.run(plan, *provisional)
        after = self.states.conv.clone(), self.states.ssm.clone()
        kept, positions = kept_states(self.states), self.states._positions
        assert sorted(kept) == sorted(plan.state_slots[c.request_id] for c in drafts)
        self.states.conv.copy_(before[0])
        self.states.ssm.copy_(before[1])
        self.runner.cpu_decode = None
        try:
            torch_chunks, reference = self.run(plan, *provisional)
        finally:
            self.runner.cpu_decode = fused
        reference = reference[in_order(chunks, torch_chunks)]  # the modules run draft chunks first
        self.worst_logits = max(self.worst_logits, relative(logits, reference))
        for mine, theirs in zip(after, (self.states.conv, self.states.ssm), strict=True):
            self.worst_state = max(self.worst_state, relative(mine, theirs))
        for slot, (conv, ssm) in kept_states(self.states).items():
            self.worst_kept = max(
                self.worst_kept, relative(kept[slot][0], conv), relative(kept[slot][1], ssm)
            )
        self.states.conv.copy_(after[0])
        self.states.ssm.copy_(after[1])
        self.states._positions = positions  # C's kept states, which the engine rewinds to
        self.steps += 1
        self.mixed_steps += len(drafts) < len(plan.chunks)
        self.rows += logits.shape[0]
        self.same_top1 += int((logits.argmax(-1) == reference.argmax(-1)).sum())
        return chunks, logits


def checked_llm(path: Path, **options: Any) -> tuple[LLM, Checked]:
    llm = LLM(
        str(path),
        dtype="float32",
        kv_cache_memory="64MiB",
        cpu_int8_activations=False,
        speculation="on",
        **options,
    )
    check = Checked(llm.engine.runner)
    llm.engine.runner.run = check  # type: ignore[method-assign]
    return llm, check


@pytest.mark.parametrize("name", ["q8_0", "q4_k_m"])
def test_draft_chunks_match_the_torch_modules(files: dict[str, Path], name: str) -> None:
    """Float32: a draft's rows through C give the modules' logits, states and per-position states, drafts
    accepted in part (a rewind to a kept state) and whole, beside plain decodes; the replies are speculation
    off's."""
    llm, check = checked_llm(files[name], cascade_attention="on")
    replies = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]  # type: ignore[arg-type]
    assert check.steps >= 3 and check.mixed_steps >= 1, (check.steps, check.mixed_steps)
    assert check.same_top1 == check.rows
    assert check.worst_logits < 1e-4, f"largest logit difference {check.worst_logits:.2e} of the largest"
    assert check.worst_state < 1e-4, f"largest state difference {check.worst_state:.2e} of the largest"
    assert check.worst_kept < 1e-4, f"largest kept-state difference {check.worst_kept:.2e} of the largest"
    assert any(kept < n for kept, n in check.rewinds), "no draft was cut short"
    assert any(kept == n for kept, n in check.rewinds), "no draft was accepted whole"
    off = LLM(str(files[name]), dtype="float32", kv_cache_memory="64MiB", cpu_int8_activations=False)
    assert replies == [o.token_ids for o in off.generate(PROMPTS, GREEDY)]  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "options",
    [dict(), dict(async_scheduling="on"), dict(max_num_batched_tokens=32)],
    ids=["prefix-hits", "async", "chunked-prefill"],
)
def test_greedy_replies_with_drafts_are_the_modules(files: dict[str, Path], options: dict[str, Any]) -> None:
    """Two rounds (the second hits the prefix cache: state snapshots taken after rewinds), C against the
    modules, speculation on."""

    def replies(**more: Any) -> list[list[int]]:
        llm = LLM(
            str(files["q8_0"]),
            dtype="float32",
            kv_cache_memory="64MiB",
            cpu_int8_activations=False,
            speculation="on",
            **options,
            **more,
        )
        out: list[list[int]] = []
        for _ in range(2):
            out += [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]  # type: ignore[arg-type]
        assert llm.engine.counters.spec_verify_steps > 0
        return out

    assert replies() == replies(fused_cpu_decode=False)
