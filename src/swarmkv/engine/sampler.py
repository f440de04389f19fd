"""Token selection for a batch: one argmax for greedy rows, per-row filtering only where it is needed."""

from __future__ import annotations

import torch

from swarmkv.engine.sampling_params import SamplingParams


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """Pick one token per row of float32 `logits` [N, vocab]."""
    chosen = logits.argmax(dim=-1)
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        probs = _filtered_probs(logits[row], p)
        chosen[row] = torch.multinomial(probs.cpu(), 1, generator=gen)[0]
    return chosen.tolist()


def _filtered_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    scaled = row / p.temperature
    if p.top_k is not None and p.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest head whose mass reaches top_p (the first token always survives).
        drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs
